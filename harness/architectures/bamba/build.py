"""A hybrid's blocks for a float recipe: the Mamba-2 blocks are Mamba-2's own (its knob interpreter, asked through
the registry: ``Architecture.extra["block"]``), the attention and MLP blocks this folder's (block.py), every op in
fp32 with its output stored in act_dtype; rotate=yes rotates the residual stream (weights.py)."""
from __future__ import annotations

from ...emulation.build import act_dtype
from ...emulation.modules import EmuLinear, EmuRMSNorm
from ...kernels.linear import Epilogue
from ...modes import ModeRecipe, Rotate
from ...spec import FloatOut, HybridDims
from ..registry import get_architecture
from .block import EmuAttentionBlock, EmuMLPBlock
from .config import ATTENTION, MLP
from .weights import AttentionParams, MLPParams

__all__ = ["build_blocks", "SSM_BLOCKS"]

SSM_BLOCKS = "mamba2"  # the architecture whose blocks a hybrid's SSM layers are


def _linear(w, act: FloatOut) -> EmuLinear:
    return EmuLinear(w, Epilogue.RATIO_THEN_WEIGHT, act)


def _attention(p: AttentionParams, dims: HybridDims, layer: int, act: FloatOut) -> EmuAttentionBlock:
    return EmuAttentionBlock(layer, dims, norm=EmuRMSNorm(p.norm_weight, dims.norm_eps, act),
                             q_proj=_linear(p.q_proj, act), k_proj=_linear(p.k_proj, act),
                             v_proj=_linear(p.v_proj, act), o_proj=_linear(p.o_proj, act), out=act)


def _mlp(p: MLPParams, dims: HybridDims, layer: int, act: FloatOut) -> EmuMLPBlock:
    return EmuMLPBlock(layer, dims, norm=EmuRMSNorm(p.norm_weight, dims.norm_eps, act),
                       gate_proj=_linear(p.gate_proj, act), up_proj=_linear(p.up_proj, act),
                       down_proj=_linear(p.down_proj, act), out=act)


def build_block(recipe: ModeRecipe, params, dims: HybridDims, layer: int):
    """Block `layer` of a float recipe from its prepared weights (its kind: dims.kinds[layer])."""
    act = FloatOut(act_dtype(recipe))
    kind = dims.kinds[layer]
    if kind == ATTENTION:
        return _attention(params, dims, layer, act)
    if kind == MLP:
        return _mlp(params, dims, layer, act)
    return get_architecture(SSM_BLOCKS).extra["block"](recipe, params, dims.ssm_dims(), layer)


def build_blocks(recipe: ModeRecipe, bank, scales, depth: int, calibration: bool = False) -> list:
    """Blocks 0..depth of a float recipe (no calibrated scales: none of its ops quantizes)."""
    rotate = recipe.rotate == Rotate.YES
    return [build_block(recipe, bank.layer(i, recipe.weights, rotate, recipe.prep), bank.dims, i)
            for i in range(depth + 1)]
