"""Quamba2's W4AX calibration of a Mamba-2 model (calibration key "quamba2-w4ax"): one W8A8 calibration, one
reorder and ONE GPTQ, from which every layer's W4A8 and W4A16 block is built.

Upstream (enyac-group/Quamba c474646 quamba/modelutils_mamba.py): with ``--hybrid_blocks --a_bits 8``,
``quantize_model_mamba`` runs the head-grouping reorder and Quamba2's calibration (:803-812), ``fuse_had_matrices``
(:830), ``apply_gptq`` once (:832-833), then ``quantize_fp16_model_act_hybrid`` (:836-844) builds layer i's W4A8
block (``W4A8QMamba2.from_fp16``) and/or its W4A16 block (``W4A16QMamba2.from_fp16``) from the SAME reordered,
GPTQ'd fp16 model (:703-732). Both ``from_fp16`` read the GPTQ'd layer's fake-quantized fp16 weight and its fp16
``group_scale`` (gptq_utils.py:179-184, qLinearLayer.py:42-70): Marlin (W4A16) packs them as they are, Marlin-QQQ
(W4A8) adds the per-channel scale. So a W4A16 layer of W4AX holds the reordered W4A8 GPTQ's codes, unlike
``q2-w4a16`` (no reorder and GPTQ without it, :820-824).

The harness: the W8A8 calibration is q2-w8a8's (its own cache); the GPTQ is recipes.quamba.w4.gptq_mamba2's loop
on the reordered raws, kept as GPTQ's result (fp16 values and fp16 group scales per layer, cache kind "gptq-w4ax")
and packed both ways with emulation.gptq.to_int4_weight, so the W4A8 layers are q2-w4a8's bit for bit.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from ....architectures.mamba2.build import build_mamba2_block
from ....architectures.mamba2.weights import float_layer_mamba2
from ....emulation.gptq import gptq_group_size, gptq_int4, to_int4_weight
from ....modes import Q2_CALIBRATION_RECIPE
from ....runner.calibcost import estimate_seconds
from ....runner.calibration import CalibrationResult, CalibrationSettings, layer_keys
from ....runner.layercache import LayerCache
from ....runtime.guard import Progress
from ..q2.calibrate import calibrate_quamba2
from ..q2.params import Q2Scales, reorder_raw
from .block_mamba2 import Q2W4Layer, in_proj_out_scales
from .calibrate_mamba2 import GPTQ_PASSES, GPTQ_VERSION, cached_layers, gptq_info
from .gptq_mamba2 import block_hessians

__all__ = ["W4AX_KEY", "W4AXLayer", "calibrate_q2w4ax", "gptq_q2_values", "w4ax_layers", "CACHE_KIND"]

W4AX_KEY = "quamba2-w4ax"
CACHE_KIND = "gptq-w4ax"  # runner.layercache: per layer GPTQ's fp16 values and fp16 group scales
_PARTS = ("in_proj", "out_proj")


@dataclass(frozen=True)
class W4AXLayer:
    """One layer's two blocks from one GPTQ: W4A8 (Marlin-QQQ, the W8A8 scales) and W4A16 (Marlin, the same codes)."""

    w4a8: Q2W4Layer
    w4a16: Q2W4Layer

    @property
    def scales(self) -> Q2Scales | None:
        """The W8A8 scales (runner.decodeplan.state_scales reads them as a Q2W4Layer's)."""
        return self.w4a8.scales

    def info(self) -> dict:
        return {"W4A8": self.w4a8.info(), "W4A16": self.w4a16.info()}


def gptq_q2_values(dims, raws: list[dict], embed, windows: torch.Tensor, batch_size: int, *, step=None) -> list:
    """recipes.quamba.w4.gptq_mamba2.gptq_q2's loop (modelutils_mamba.py:388-476), returning GPTQ's own result per
    block: ((in_proj values, group scales), (out_proj values, group scales)), unpacked."""
    recipe = Q2_CALIBRATION_RECIPE
    with torch.no_grad():
        residuals = [embed(batch) for batch in windows.split(batch_size)]
    out = []
    for i, raw in enumerate(raws):
        p = float_layer_mamba2(raw, True, torch.float16)
        h_in, h_out = block_hessians(build_mamba2_block(recipe, p, dims, i), residuals, dims)
        q_in, s_in = gptq_int4(p.in_proj, h_in.H, gptq_group_size(dims.d_model))
        q_out, s_out = gptq_int4(p.out_proj, h_out.H, gptq_group_size(dims.d_inner))
        out.append(((q_in, s_in), (q_out, s_out)))
        block = build_mamba2_block(recipe, replace(p, in_proj=q_in, out_proj=q_out), dims, i)
        with torch.no_grad():
            residuals = [block(r)[1] for r in residuals]
        if step is not None:
            step()
    return out


def _shapes(dims) -> dict[str, tuple[int, int]]:
    gs = dims.ngroups * dims.d_state
    return {"in_proj": (2 * dims.d_inner + 2 * gs + dims.nheads, dims.d_model), "out_proj": (dims.d_model, dims.d_inner)}


def _cache(cache_dir: Path | None, dims) -> LayerCache:
    """fp16 values (2 bytes a weight) and fp16 group scales: at most 3 bytes a weight and a MiB."""
    return LayerCache(cache_dir, CACHE_KIND, max_bytes=3 * sum(r * c for r, c in _shapes(dims).values()) + (1 << 20))


def _arrays(layer) -> dict[str, np.ndarray]:
    return {f"{part}.{name}": t.to(torch.float16).numpy()
            for part, (q, s) in zip(_PARTS, layer) for name, t in (("values", q), ("group_scales", s))}


def _from_arrays(arrays: dict[str, np.ndarray], dims) -> tuple:
    """ValueError naming what does not fit the model."""
    shapes, out = _shapes(dims), []
    for part in _PARTS:
        try:
            q = torch.from_numpy(arrays[f"{part}.values"]).to(torch.float32)
            s = torch.from_numpy(arrays[f"{part}.group_scales"]).to(torch.float32)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"bad {part} ({type(e).__name__}: {e})") from None
        rows, cols = shapes[part]
        groups = cols // gptq_group_size(cols)
        if tuple(q.shape) != (rows, cols) or tuple(s.shape) != (rows, groups) or \
                arrays[f"{part}.values"].dtype != np.float16:
            raise ValueError(f"{part} does not fit the model (values {tuple(q.shape)}, scales {tuple(s.shape)})")
        out.append((q, s))
    return tuple(out)


def w4ax_layers(values: list, scales: list[Q2Scales], dims) -> list[W4AXLayer]:
    """Both packings of each layer's GPTQ result: W4A8 as q2w4_layers packs it (Marlin-QQQ, the splits' output scales
    fused into in_proj's channel scales), W4A16 as Marlin (emulation.gptq.to_int4_weight)."""
    out = []
    for ((q_in, s_in), (q_out, s_out)), s in zip(values, scales):
        w4a8 = Q2W4Layer(in_proj_out_scales(to_int4_weight(q_in, s_in, True), s, dims),
                         to_int4_weight(q_out, s_out, True), s)
        w4a16 = Q2W4Layer(to_int4_weight(q_in, s_in, False), to_int4_weight(q_out, s_out, False), None)
        out.append(W4AXLayer(w4a8, w4a16))
    return out


def calibrate_q2w4ax(bank, windows: torch.Tensor, settings: CalibrationSettings, depth: int, prefix_hashes: list[str],
                     cache_dir: Path | None, *, progress=None) -> CalibrationResult:
    """W4AXLayer of blocks 0..depth (module docstring)."""
    progress = Progress() if progress is None else progress
    q2 = calibrate_quamba2(bank, windows, settings, depth, prefix_hashes, cache_dir, progress=progress)
    keys = layer_keys(prefix_hashes[: depth + 1], windows, settings, f"{W4AX_KEY}-gptq-v{GPTQ_VERSION}")
    info = {**gptq_info(W4AX_KEY, settings, windows, keys, bank.dims), "w8a8": q2.info}
    start = time.perf_counter()

    def compute(step) -> list:
        dims = bank.dims
        raws = [reorder_raw(bank.raw(i), s.reorder, dims.d_inner, dims.nheads) for i, s in zip(range(depth + 1), q2.scales)]
        embed = lambda ids: bank.embed(ids, True, torch.float16, "exact", "fp16")  # noqa: E731
        values = gptq_q2_values(dims, raws, embed, windows, settings.batch_size, step=step)
        # GPTQ's values are fp16 numbers and to_int4_weight reads them in fp16: the cached form is exact
        return [tuple((q.to(torch.float16).to(torch.float32), s.to(torch.float16).to(torch.float32)) for q, s in layer)
                for layer in values]

    values = _cached_values(_cache(cache_dir, bank.dims), keys, bank.dims, compute, info, progress,
                            title=f"GPTQ ({W4AX_KEY}, {windows.shape[0]} x {windows.shape[1]} tokens, layers 0..{depth})",
                            tokens=windows.numel())
    layers = w4ax_layers(values, q2.scales, bank.dims)
    info.update(seconds=round(time.perf_counter() - start, 3), layers=[x.info() for x in layers])
    return CalibrationResult(layers, info)


def _cached_values(cache: LayerCache, keys: list[str], dims, compute, info: dict, progress: Progress, *,
                   title: str, tokens: int) -> list:
    """GPTQ's values through calibrate_mamba2.cached_layers (info gets source, reason, cache_files)."""
    estimate = estimate_seconds(tokens, len(keys), dims, GPTQ_PASSES["mamba2"])
    return cached_layers(cache, keys, lambda _i, entry: _from_arrays(entry.arrays, dims),
                         lambda i, layer: ({"layer": i}, _arrays(layer)), compute, info, progress, title=title,
                         estimate=estimate)
