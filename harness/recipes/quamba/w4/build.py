"""Quamba2's W4A8 and W4A16 blocks: on Mamba-2 Quamba2's own, on Mamba-1 the linears swapped into mode 0's (W4A8)
or the fp16 calibration block (W4A16), as Quamba2 prepares a Mamba-1 model as Quamba1. On a hybrid (Bamba / Granite
4.0-H, Nemotron-H) the Mamba-2 blocks are Quamba2's W4 blocks and the attention and MLP blocks stay in rotated fp16
under both W4A8 and W4A16 (q2.hybrid.HYBRID_FLOAT_RECIPE, as q2-w8a8 keeps them): Quamba quantizes no attention
(enyac-group/Quamba c474646 quamba/quamba_mixer_seq.py:112 walks the Mamba mixers only), and GPTQ runs its
calibration forward through them in fp16 (w4.gptq_mamba2)."""
from __future__ import annotations

from dataclasses import replace

import torch

from ....architectures.bamba.build import float_block, is_ssm_block
from ....architectures.mamba1.build import build_block
from ....architectures.mamba1.weights import LayerParams
from ....architectures.mamba2.build import build_mamba2_block
from ....architectures.mamba2.weights import float_layer_mamba2
from ....emulation.modules import EmuMambaBlock
from ....kernels.scan import ScanOrder
from ....modes import BUILTIN_MODES, CALIBRATION_RECIPES, ModeRecipe, Prep, SsmImpl
from ....spec import Mamba2Dims, ModelDims
from ..q2.calibration import ssm_dims
from ..q2.hybrid import HYBRID_FLOAT_RECIPE
from . import block_mamba1 as mamba1_w4
from .block_mamba2 import Q2W4Layer, build_q2w4a8_block, with_w4a16_linears

__all__ = ["build_q2w4_mamba2_block", "build_q2w4_mamba1_block", "build_blocks_mamba2", "build_blocks_mamba1"]


def build_q2w4_mamba2_block(recipe: ModeRecipe, raw: dict | None, w4: Q2W4Layer, dims: Mamba2Dims, layer: int,
                            params=None):
    """One Quamba2 W4A8 block (w4.scales: the W8A8 scales; raw reordered by them, then q2-w8a8's parts with
    GPTQ's Marlin-QQQ linears) or W4A16 block (no scales: the fp16 rotated block with Marlin linears); params:
    the block's other tensors as a W4 checkpoint stores them (Q2Params, Mamba2Params) instead of raw's."""
    chunked = recipe.ssm_impl == SsmImpl.KERNEL
    if w4.scales is not None:
        return build_q2w4a8_block(layer, dims, raw, w4, chunked, params=params, state_dtype=str(recipe.state_dtype))
    p = float_layer_mamba2(raw, True, torch.float16) if params is None else params
    return with_w4a16_linears(build_mamba2_block(recipe, p, dims, layer), w4)


def build_q2w4_mamba1_block(recipe: ModeRecipe, p: LayerParams, w4: "mamba1_w4.Q1W4Layer", dims: ModelDims,
                            layer: int) -> EmuMambaBlock:
    """One Quamba2 W4A8 Mamba-1 block (w4.scales: mode 0's; p: mode 0's int8 parameters) or W4A16 block (no
    scales; p: the prep=quamba fp16 parameters), recipes.quamba.w4.block_mamba1. ssm_impl=kernel: Quamba's QSScan (W4A8),
    mamba_ssm's selective_scan_fn (W4A16); reference: the fork's reference loop, on the same inputs."""
    kernel = recipe.ssm_impl == SsmImpl.KERNEL
    if w4.scales is not None:
        base = replace(BUILTIN_MODES["0"], ssm_impl=recipe.ssm_impl)
        return mamba1_w4.with_w4a8_linears(build_block(base, p, w4.scales, dims, layer), w4)
    block = build_block(CALIBRATION_RECIPES[Prep.QUAMBA], p, None, dims, layer, calibration=True)
    block.ssm.order = ScanOrder.MAMBA if kernel else ScanOrder.TORCH
    return mamba1_w4.with_w4a16_linears(block, w4)


def build_blocks_mamba2(recipe: ModeRecipe, bank, scales: list, depth: int, calibration: bool = False) -> list:
    """Blocks 0..depth on Mamba-2: a Quamba2 W4 checkpoint's own tensors where the bank holds one, else GPTQ's; a
    hybrid's attention and MLP blocks in rotated fp16 (module docstring)."""
    given = getattr(bank, "q2_given", lambda _i, _k: None)
    dims = ssm_dims(bank.dims)

    def block(i: int):
        if not is_ssm_block(bank.dims, i):
            return float_block(HYBRID_FLOAT_RECIPE, bank.raw(i), bank.dims, i)
        if (p := given(i, recipe.calibration_key)) is not None:
            return build_q2w4_mamba2_block(recipe, None, scales[i], dims, i, params=p)
        return build_q2w4_mamba2_block(recipe, bank.raw(i), scales[i], dims, i)
    return [block(i) for i in range(depth + 1)]


def build_blocks_mamba1(recipe: ModeRecipe, bank, scales: list, depth: int, calibration: bool = False) -> list:
    """Blocks 0..depth on Mamba-1 (Quamba1's preparation): a W4 Mamba-1 checkpoint's own where the bank holds one."""
    given = getattr(bank, "q2_given", lambda _i, _k: None)
    return [build_q2w4_mamba1_block(recipe, p if (p := given(i, recipe.calibration_key)) is not None else
                                    bank.layer(i, "fp16" if scales[i].scales is None else "int8", True, Prep.QUAMBA),
                                    scales[i], bank.dims, i) for i in range(depth + 1)]
