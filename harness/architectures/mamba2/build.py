"""The Mamba-2 block of a float recipe (modes.MAMBA2_KNOBS say which knobs apply)."""
from __future__ import annotations

from ...emulation.build import act_dtype
from ...emulation.modules import EmuHadamard, EmuLinear, EmuRMSNorm
from ...emulation.state import StateRule
from ...kernels.linear import Epilogue
from ...modes import ModeRecipe, Rotate, SsmImpl
from ...spec import FloatOut, Mamba2Dims
from .block import EmuConvXBC, EmuGatedNorm, EmuMamba2Block, EmuSSD
from .weights import Mamba2Params

__all__ = ["build_mamba2_block", "build_blocks"]


def build_mamba2_block(recipe: ModeRecipe, p: Mamba2Params, dims: Mamba2Dims, layer: int) -> EmuMamba2Block:
    """One Mamba-2 block of a float recipe (modes.MAMBA2_KNOBS says which knobs apply): every op in fp32
    arithmetic, each output rounded to act_dtype; ssm_impl=kernel is the chunked SSD (as the kernels and
    transformers compute it), reference the token-by-token recurrence; rotate=yes rotates the residual
    stream and adds the online Hadamard after the gated norm (weights_mamba2)."""
    act = FloatOut(act_dtype(recipe))
    return EmuMamba2Block(
        layer, dims,
        norm=EmuRMSNorm(p.norm_weight, dims.norm_eps, act),
        in_proj=EmuLinear(p.in_proj, Epilogue.RATIO_THEN_WEIGHT, act),
        conv1d=EmuConvXBC(p.conv_weight, p.conv_bias, act),
        dt_bias=p.dt_bias,
        ssd=EmuSSD(dims, p.A_log, p.D, p.dt_bias, recipe.ssm_impl == SsmImpl.KERNEL, act,
                   StateRule(None, act_dtype(recipe))),
        gnorm=EmuGatedNorm(p.gnorm_weight, dims.ngroups, dims.gnorm_eps, act),
        had=EmuHadamard(act) if recipe.rotate == Rotate.YES else None,
        out_proj=EmuLinear(p.out_proj, Epilogue.WEIGHT_THEN_RATIO, act),
    )


def build_blocks(recipe: ModeRecipe, bank, scales, depth: int, calibration: bool = False) -> list[EmuMamba2Block]:
    """Blocks 0..depth of a float recipe on Mamba-2 (no calibrated scales: none of its ops quantizes)."""
    rotate = recipe.rotate == Rotate.YES
    return [build_mamba2_block(recipe, bank.layer(i, recipe.weights, rotate, recipe.prep), bank.dims, i)
            for i in range(depth + 1)]
