"""Quamba2's calibration of a Mamba-2 model for W8A8 (enyac-group/Quamba c474646 quamba/modelutils_mamba.py:797-812).

Two passes of the rotated fp16 model (fp16 weights, every op's output rounded to fp16: Quamba calibrates its fp16
model) over the calibration windows:

1. channel statistics of x (``get_act_channel_stats_mamba2``, quamba/reorder_utils.py:13-48): per sample, the
   mean of |x| over its tokens at ``x_conv_out`` (the conv + SiLU output), kept as the running max over samples;
   then the head/dim grouping of every block (emulation.grouping_q2; reorder_utils.py:138-170);
2. the same model with the reordered weights (recipes.quamba.q2.params.reorder_raw), every observer of
   ``run_quamba2_calibration`` (modelutils_mamba.py:236-372): min-max per tensor, the cross-head min-max of x,
   the per-SSD-group min-max of B and C (recipes.quamba.q2.params lists them), the per-tensor percentile of x that
   Quamba's non-grouped path would take (``s_x_tensor``, for the x_groups=tensor variant), and the cross-head
   min-max of the final SSM state per state index (``ssm_state_act``, modelutils_mamba.py:297-306: the decode
   step's scale).

The mean in pass 1 is an fp32 sum of the fp16 values in a fixed order, rounded to fp16 (torch.mean of an fp16
CUDA tensor accumulates in fp32 in its own order; the stored fp16 mean rarely differs).
"""
from __future__ import annotations

from typing import Callable

import torch

from ....spec import HookPoint, Mamba2Dims
from ....architectures.mamba2.build import build_mamba2_block
from ....architectures.mamba2.config import MAMBA2_LAYER_TENSORS
from .grouping import GroupReorder, group_wise_sort_indices
from ....emulation.modules import EmuBackbone
from ..observers import MinMaxObserver, PercentileObserver
from .observers import CachedStatesObserver, CrossHeadMinmaxObserver
from ....kernels import portable
from .linear import LinearScales, linear_observers, linear_scales
from .params import Q2Scales, reorder_raw
from ....architectures.mamba2.weights import float_layer_mamba2
from ....architectures.bamba.build import float_block, is_ssm_block

__all__ = ["calibrate_q2", "check_finite_weights", "q2_grouping_problem", "PerSSDGroupObserver", "ssm_dims"]

_MINMAX = {"norm.out": "s_in", "in_proj.z": "s_z", "in_proj.dt": "s_dt", "had.out": "s_H"}


class PerSSDGroupObserver:
    """quamba/observer.py:121-170 (sym): the running max over batches of max(|B| over an SSD group, 1e-5), in
    fp16 (the calibration tensor's dtype); scale = f16(amax / 127), then fp32, at least 1e-6 (:16-31)."""

    def __init__(self, d_state: int) -> None:
        self.d_state, self.amax = d_state, None

    def observe(self, x: torch.Tensor) -> None:
        b, L, n = x.shape
        cur = x.to(torch.float16).reshape(b * L, n // self.d_state, self.d_state).abs().amax(dim=(0, 2))
        cur = cur.clamp(min=1e-5)
        self.amax = cur if self.amax is None else torch.maximum(self.amax, cur)

    def scales(self) -> torch.Tensor:
        return (self.amax / 127).to(torch.float32).clamp(min=1e-6)


def ssm_dims(dims) -> Mamba2Dims:
    """The Mamba-2 blocks' dims: the model's, or a hybrid's (spec.HybridDims.ssm_dims)."""
    return dims.ssm_dims() if hasattr(dims, "ssm_dims") else dims


def _model(dims, raws: list[dict], embed: Callable, recipe) -> EmuBackbone:
    """The rotated fp16 calibration model; a hybrid's attention and MLP blocks are its own float blocks."""
    def block(i: int, raw: dict):
        if not is_ssm_block(dims, i):
            return float_block(recipe, raw, dims, i)
        return build_mamba2_block(recipe, float_layer_mamba2(raw, True, torch.float16), ssm_dims(dims), i)
    return EmuBackbone(embed, [block(i, raw) for i, raw in enumerate(raws)])


def _hook(model: EmuBackbone, want: Callable[[int, str], Callable | None]) -> list:
    handles = []
    for module in model.modules():
        if isinstance(module, HookPoint) and (fn := want(module.layer, module.point)) is not None:
            handles.append(module.register_forward_hook(lambda _m, _i, out, fn=fn: fn(out)))
    return handles


def _run(model: EmuBackbone, handles: list, windows: torch.Tensor, batch_size: int, step: Callable | None) -> None:
    try:
        for batch in windows.split(batch_size):
            model(batch)
            if step is not None:
                step()
    finally:
        for h in handles:
            h.remove()


def _channel_stats(model: EmuBackbone, depth: int, windows: torch.Tensor, batch_size: int, step) -> list:
    stats: list[torch.Tensor | None] = [None] * (depth + 1)

    def observe(layer: int, x: torch.Tensor) -> None:
        b, L, n = x.shape
        sums = portable.sum_last(x.abs().transpose(1, 2).contiguous())          # (b, n), fixed order
        cur = (sums / L).to(torch.float16).to(torch.float32).amax(dim=0)
        stats[layer] = cur if stats[layer] is None else torch.maximum(stats[layer], cur)

    want = lambda layer, point: (lambda x, l=layer: observe(l, x)) if point == "conv1d.x" else None  # noqa: E731
    _run(model, _hook(model, want), windows, batch_size, step)
    return stats


def check_finite_weights(layer: int, raw: dict) -> None:
    """Every tensor of block `layer` finite; a ValueError naming the first that is not (a NaN would reach the
    head/dim clustering, whose own message is scikit-learn's about imputers)."""
    for name, t in raw.items():
        bad = None if t is None else ~torch.isfinite(t)
        if bad is not None and bad.any():
            where = [int(i) for i in bad.nonzero()[0]]
            raise ValueError(f"layer {layer}: tensor backbone.layers.{layer}.{MAMBA2_LAYER_TENSORS.get(name, name)} "
                             f"holds {int(bad.sum())} non-finite value(s) (NaN or inf), first at {where}: "
                             f"{float(t[tuple(where)])}; Quamba2's calibration needs finite weights")


def _grouping(layer: int, stats: torch.Tensor, dims: Mamba2Dims) -> GroupReorder:
    try:
        return group_wise_sort_indices(stats, dims.headdim, dims.ngroups)
    except ValueError as e:
        raise ValueError(f"layer {layer}: {e}") from None


def q2_grouping_problem(dims: Mamba2Dims) -> str | None:
    """Why Quamba2's head/dim grouping of the SSD input cannot split this model, or None (the run, the export and
    the calibration ask the same question)."""
    if dims.nheads // dims.ngroups < 4 or dims.headdim < 4:
        return (f"Quamba2 groups each SSD group's heads into 4 head groups and each head's channels into 4 "
                f"dim groups; this model has {dims.nheads // dims.ngroups} heads per SSD group and headdim "
                f"{dims.headdim} (at least 4 of each are needed)")
    return None


def calibrate_q2(model_dims, raw: Callable[[int], dict], embed: Callable, windows: torch.Tensor, depth: int,
                 batch_size: int, recipe, *, step: Callable | None = None,
                 alpha: float = 0.9995) -> list[Q2Scales | LinearScales]:
    """Scales of blocks 0..depth. raw(i): block i's checkpoint tensors (fp32); embed(ids): the rotated fp16
    embedding; recipe: the float calibration recipe (fp16 weights and activations, rotated, chunked SSD);
    alpha: the percentile of s_x_tensor (Quamba's non-grouped x observer, modelutils_mamba.py:132). A hybrid's
    (spec.HybridDims) attention and MLP blocks run in the calibration model as its rotated fp16 blocks and get the
    static input scales of their linears (q2.linear.LinearScales), observed in the same pass."""
    dims = ssm_dims(model_dims)
    if (problem := q2_grouping_problem(dims)) is not None:
        raise ValueError(problem)
    raws = [raw(i) for i in range(depth + 1)]
    ssm = [is_ssm_block(model_dims, i) for i in range(depth + 1)]
    for i, r in enumerate(raws):
        if ssm[i]:
            check_finite_weights(i, r)
    stats = _channel_stats(_model(model_dims, raws, embed, recipe), depth, windows, batch_size, step)
    reorders = [_grouping(i, st, dims) if ssm[i] else None for i, st in enumerate(stats)]
    model = _model(model_dims, [r if g is None else reorder_raw(r, g, dims.d_inner, dims.nheads)
                                for r, g in zip(raws, reorders)], embed, recipe)
    gs = dims.ngroups * dims.d_state
    kinds = getattr(model_dims, "kinds", None)
    obs = [linear_observers(kinds[i]) if g is None else
           {**{k: MinMaxObserver() for k in ("s_in", "s_z", "s_x", "s_B", "s_C", "s_dt", "s_H")},
            "x": CrossHeadMinmaxObserver(dims.ngroups, dims.headdim, g.head_groups, g.dim_groups),
            "B": PerSSDGroupObserver(dims.d_state), "C": PerSSDGroupObserver(dims.d_state),
            "s_x_tensor": PercentileObserver(alpha),
            "state": CachedStatesObserver(dims.ngroups, dims.headdim, g.head_groups, g.dim_groups)}
           for i, g in enumerate(reorders)]

    def x_out(o: dict, t: torch.Tensor) -> None:
        o["x"].update(t.to(torch.float16).to(torch.float32))
        o["s_x_tensor"].observe(t)

    def xbc(o: dict, t: torch.Tensor) -> None:
        x, B, C = t.split([dims.d_inner, gs, gs], dim=-1)
        o["s_x"].observe(x)
        o["s_B"].observe(B)
        o["s_C"].observe(C)

    def want(layer: int, point: str):
        o = obs[layer]
        if reorders[layer] is None:  # a hybrid's attention or MLP block: its linears' input scales
            return o[point].observe if point in o else None
        if point in _MINMAX:
            return o[_MINMAX[point]].observe
        if point == "in_proj.xBC":
            return lambda t: xbc(o, t)
        if point == "conv1d.x":
            return lambda t: x_out(o, t)
        if point == "ssd.state":  # the prefill's final state, copied into the fp16 cache (qMamba2.py:250-259)
            return lambda t: o["state"].update(t.to(torch.float16))
        return {"conv1d.B": o["B"].observe, "conv1d.C": o["C"].observe}.get(point)

    _run(model, _hook(model, lambda layer, point: want(layer, point) if layer <= depth else None), windows,
         batch_size, step)
    return [linear_scales(kinds[i], o) if g is None else
            Q2Scales(**{k: o[k].compute_scale() for k in ("s_in", "s_z", "s_x", "s_B", "s_C", "s_dt", "s_H")},
                     x_table=o["x"].scales(), B_scales=o["B"].scales(), C_scales=o["C"].scales(), reorder=g,
                     s_x_tensor=o["s_x_tensor"].compute_scale(), ssm_state_scale=o["state"].scales())
            for i, (o, g) in enumerate(zip(obs, reorders))]
