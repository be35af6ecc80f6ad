"""Quamba's ``apply_gptq`` of a Mamba-2 model, on CPU (enyac-group/Quamba c474646 quamba/modelutils_mamba.py:388-476).

Layer by layer over the calibration windows, on the rotated fp16 model (``fuse_had_matrices`` runs before GPTQ,
:828-833; for W4A8 the weights are reordered by the W8A8 calibration's head/dim groups first, :801-812):

1. the inputs of block i are the outputs of blocks 0..i-1 *with their GPTQ weights* (the layers' weights are
   replaced by GPTQ's fake-quantized fp16 values, gptq_utils.py:175-180, and :469-470 recomputes the inputs);
2. one forward of block i (float weights) feeds the Hessians of in_proj (its input: the norm output) and of
   out_proj (its input: the online Hadamard's output; HadLinear's weight holds the fused Hadamard, so its
   input is the rotated activation, qLinearLayer.py:860-877), one ``add_batch`` per sequence (:451-455);
3. ``fasterquant`` of in_proj, then of out_proj (:460-465; the two are independent), emulation.gptq.

On a hybrid (Bamba / Granite 4.0-H, Nemotron-H) the loop runs every block in order: a Mamba-2 block as above, an
attention or MLP block as the rotated fp16 float block it stays in the run (architectures.bamba.build.float_block),
its linears not quantized (Quamba quantizes no attention: ``quantize_model_mamba`` walks the Mamba mixers only,
c474646 quamba/quamba_mixer_seq.py:112), so each Mamba-2 block's Hessians see the outputs of the blocks before it
with their GPTQ weights, as :469-470 chains Mamba-2 layers.

The calibration text is the run's calibration windows (Quamba draws 128 x 1024 tokens of wikitext2 for GPTQ,
:391-401, apart from its activation calibration). The embedding and lm_head GPTQ (:478-507) are not run: the
harness's W4 modes keep Quamba2's fp16 embedding and head, as q2-w8a8 does (docs/modes.md).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from ....spec import HookPoint, Mamba2Dims
from ....architectures.bamba.build import float_block, is_ssm_block
from ....architectures.mamba2.build import build_mamba2_block
from ....emulation.gptq import Hessian, gptq_group_size, gptq_int4, to_int4_weight
from .block_mamba2 import Q2W4Layer, in_proj_out_scales
from ....architectures.mamba2.weights import float_layer_mamba2

__all__ = ["gptq_q2", "q2w4_layers", "block_hessians"]


def _feed(h: Hessian, out: torch.Tensor) -> None:
    for seq in out.to(torch.float32):  # one add_batch per sequence, as Quamba
        h.add(seq)


def block_hessians(block, residuals: list[torch.Tensor], dims: Mamba2Dims) -> tuple[Hessian, Hessian]:
    """The Hessians of in_proj (its input: norm.out) and out_proj (had.out) over one forward of `block` per batch."""
    h_in, h_out = Hessian(dims.d_model), Hessian(dims.d_inner)
    want = {"norm.out": h_in, "had.out": h_out}
    handles = []
    for module in block.modules():
        if isinstance(module, HookPoint) and module.point in want:
            h = want[module.point]
            handles.append(module.register_forward_hook(
                lambda _m, _i, out, h=h: _feed(h, out)))
    try:
        with torch.no_grad():
            for r in residuals:
                block(r)
    finally:
        for handle in handles:
            handle.remove()
    return h_in, h_out


def gptq_q2(model_dims, raws: list[dict], embed: Callable, windows: torch.Tensor, batch_size: int, recipe,
            channel: bool, *, step: Callable | None = None) -> list[tuple[object, object] | None]:
    """GPTQ of in_proj and out_proj of blocks 0..len(raws)-1. model_dims: Mamba2Dims, or a hybrid's HybridDims
    (its attention and MLP blocks run in fp16, module docstring); raws: the blocks' checkpoint tensors (reordered
    for W4A8); embed(ids): the rotated fp16 embedding; recipe: the fp16 calibration recipe; channel: Marlin-QQQ
    (W4A8) weights, else Marlin (W4A16). step: called after each block.
    Returns per block (in_proj Int4Weight, out_proj Int4Weight), None for an attention or MLP block."""
    dims = model_dims.ssm_dims() if hasattr(model_dims, "ssm_dims") else model_dims
    with torch.no_grad():
        residuals = [embed(batch) for batch in windows.split(batch_size)]
    out: list[tuple[object, object] | None] = []
    for i, raw in enumerate(raws):
        if not is_ssm_block(model_dims, i):
            out.append(None)
            residuals = _through(float_block(recipe, raw, model_dims, i), residuals, step)
            continue
        p = float_layer_mamba2(raw, True, torch.float16)
        h_in, h_out = block_hessians(build_mamba2_block(recipe, p, dims, i), residuals, dims)
        q_in, s_in = gptq_int4(p.in_proj, h_in.H, gptq_group_size(dims.d_model))
        q_out, s_out = gptq_int4(p.out_proj, h_out.H, gptq_group_size(dims.d_inner))
        out.append((to_int4_weight(q_in, s_in, channel), to_int4_weight(q_out, s_out, channel)))
        block = build_mamba2_block(recipe, replace(p, in_proj=q_in, out_proj=q_out), dims, i)
        residuals = _through(block, residuals, step)
    return out


def _through(block, residuals: list[torch.Tensor], step: Callable | None) -> list[torch.Tensor]:
    """The residual stream after `block` (the next block's inputs)."""
    with torch.no_grad():
        residuals = [block(r)[1] for r in residuals]
    if step is not None:
        step()
    return residuals


def q2w4_layers(weights: list[tuple | None], scales: list | None, dims: Mamba2Dims) -> list[Q2W4Layer | None]:
    """GPTQ's weights with the W8A8 scales of each block (None for W4A16); for W4A8 the splits' output scales
    are divided into in_proj's channel scales (``w4a8_quantize(out_scales=)``, marlin_utils.py:254-256). A hybrid's
    attention or MLP block (no weights) is None."""
    scales = [None] * len(weights) if scales is None else scales
    return [None if w is None else
            Q2W4Layer(w[0] if s is None else in_proj_out_scales(w[0], s, dims), w[1], s)
            for w, s in zip(weights, scales)]

