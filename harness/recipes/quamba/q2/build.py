"""The Quamba2 W8A8 block (prep=quamba2) from the checkpoint's tensors and the calibrated scales, or from a Quamba2
checkpoint's own codes."""
from __future__ import annotations

from dataclasses import replace

import torch

from ....modes import ModeRecipe, SsmImpl, XGroups
from ....spec import Mamba2Dims
from .block import build_q2_block
from .params import Q2Params, Q2Scales, q2_params

__all__ = ["build_q2_mamba2_block", "build_blocks"]


def build_q2_mamba2_block(recipe: ModeRecipe, raw: dict | None, scales: Q2Scales, dims: Mamba2Dims, layer: int,
                          params: Q2Params | None = None):
    """One Quamba2 W8A8 block (prep=quamba2): the checkpoint's tensors reordered by the calibrated head/dim
    groups, folded and rotated in fp16, quantized (q2_params), or `params` as a Quamba2 checkpoint stores them;
    ssm_impl=kernel the chunked SSD, reference the token-by-token recurrence, on the same dequantized inputs;
    x_groups=tensor: every entry of the x scale table is the per-tensor s_x_tensor (the grouped conv and SSD then
    quantize x at one scale; a calibration from the float model only); state_dtype: the block's decode state
    (EmuQ2Mamba2Block.state_dtype)."""
    if recipe.x_groups == XGroups.TENSOR:
        if scales.s_x_tensor is None or params is not None:
            raise ValueError(f"mode {recipe.name!r} (x_groups=tensor) needs the per-tensor x scale s_x_tensor, "
                             f"which layer {layer} does not have (a Quamba2 checkpoint stores the grouped table "
                             f"only): calibrate from the float model")
        scales = replace(scales, x_table=torch.full_like(scales.x_table, scales.s_x_tensor))
    params = q2_params(raw, scales, dims) if params is None else params
    return build_q2_block(layer, dims, params, scales, recipe.ssm_impl == SsmImpl.KERNEL,
                          state_dtype=str(recipe.state_dtype))


def build_blocks(recipe: ModeRecipe, bank, scales: list[Q2Scales], depth: int, calibration: bool = False) -> list:
    """Blocks 0..depth: a Quamba2 checkpoint's own codes where the bank holds one (WeightBank.q2_given), else the
    float model's tensors quantized with the calibrated scales."""
    given = getattr(bank, "q2_given", lambda _i, _k: None)
    return [build_q2_mamba2_block(recipe, None, scales[i], bank.dims, i, params=p)
            if (p := given(i, recipe.calibration_key)) is not None
            else build_q2_mamba2_block(recipe, bank.raw(i), scales[i], bank.dims, i) for i in range(depth + 1)]
