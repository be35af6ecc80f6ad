"""Quamba's ``apply_gptq`` of a Mamba-1 model, on CPU (enyac-group/Quamba c474646 quamba/modelutils_mamba.py:388-476).

As for Mamba-2 (recipes.quamba.w4.gptq_mamba2), layer by layer over the calibration windows, on the model ``configure_model``
prepared (:58-81, the rotated fp16 ``MambaSimple`` blocks, Hadamards fused into in_proj and out_proj by
``fuse_had_matrices`` before GPTQ, :828-833): Quamba1's preparation, the harness's prep=quamba calibration model
(build.build_block with calibration=True, the fp16 model its W8A8 scales are observed on):

1. block i's inputs are the outputs of blocks 0..i-1 with their GPTQ weights (:467-469);
2. one forward of block i feeds the Hessians of in_proj (its input: the norm output, the norm weight folded
   into in_proj) and of out_proj (its input: the online Hadamard's output), one ``add_batch`` per sequence
   (:443-455);
3. ``fasterquant`` of in_proj, then out_proj (:460-465), emulation.gptq. x_proj and dt_proj are not GPTQ'd
   (:443-446); the W4 mixers quantize x_proj by round to nearest (kernels.int4) and keep dt_proj (fp16 or W8A8).

The calibration text is the run's calibration windows (Quamba draws 128 x 1024 tokens of wikitext2, :391-401).
The lm_head GPTQ (:478-507) is not run: the W4 modes keep the fp16 head (docs/modes.md).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from ....modes import CALIBRATION_RECIPES, Prep
from ....spec import ModelDims
from ....architectures.mamba1.build import build_block
from ....emulation.gptq import gptq_group_size, gptq_int4, to_int4_weight
from ....kernels.int4 import Int4Weight
from .gptq_mamba2 import block_hessians
from ....architectures.mamba1.weights import LayerParams

__all__ = ["gptq_mamba1"]


def gptq_mamba1(dims: ModelDims, params: list[LayerParams], embed: Callable, windows: torch.Tensor,
                batch_size: int, channel: bool, *,
                step: Callable | None = None) -> list[tuple[Int4Weight, Int4Weight]]:
    """GPTQ of in_proj and out_proj of blocks 0..len(params)-1. params: the blocks' prep=quamba fp16 parameters;
    embed(ids): the rotated fp16 embedding; channel: Marlin-QQQ (W4A8) weights, else Marlin (W4A16); step: called
    after each layer. Returns per block (in_proj, out_proj) before any output scale is fused."""
    recipe = CALIBRATION_RECIPES[Prep.QUAMBA]
    with torch.no_grad():
        residuals = [embed(batch) for batch in windows.split(batch_size)]
    out = []
    for i, p in enumerate(params):
        block = build_block(recipe, p, None, dims, i, calibration=True)
        h_in, h_out = block_hessians(block, residuals, dims)
        q_in, s_in = gptq_int4(p.in_proj, h_in.H, gptq_group_size(dims.d_model))
        q_out, s_out = gptq_int4(p.out_proj, h_out.H, gptq_group_size(dims.d_inner))
        out.append((to_int4_weight(q_in, s_in, channel), to_int4_weight(q_out, s_out, channel)))
        block = build_block(recipe, replace(p, in_proj=q_in, out_proj=q_out), None, dims, i, calibration=True)
        with torch.no_grad():
            residuals = [block(r)[1] for r in residuals]
        if step is not None:
            step()
    return out
