"""The one place that turns a mode recipe into emulated modules (MODES.md knobs -> module settings).

Rules beyond the knob table, for recipes that mix float and int8 pieces:

* a linear or conv layer runs the int8 kernel when its weights are int8 and its
  input is int8; otherwise it multiplies real values in fp32;
* x_proj and dt_proj outputs are int8 (at s_xp, s_dt) exactly when weights are int8;
* an int8 conv quantizes a float input at s_xz (conv_in=static) or per call
  (conv_in=dynamic); x_proj (int8 weights) quantizes a float conv output at s_u (RNE);
* the online Hadamard exists only with rotate=yes (out_proj absorbed Had_E);
* out_proj's output, the embedding and the float paths use act_dtype; the SSM
  output y is rounded to act_dtype.
"""
from __future__ import annotations

import torch

from .modes import ModeRecipe
from .modules import ConvInput, EmuBackbone, EmuConv1d, EmuHadamard, EmuLinear, EmuMambaBlock, EmuRMSNorm, \
    EmuSelectiveScan, UInput
from .ops.linear import Epilogue
from .ops.scan import ScanOrder
from .spec import FLOAT_DTYPES, FloatOut, LayerScales, ModelDims, OutSpec, QuantOut, Rounding
from .weights import LayerParams, WeightBank

__all__ = ["build_block", "build_backbone", "act_dtype"]

def act_dtype(recipe: ModeRecipe) -> torch.dtype:
    return FLOAT_DTYPES[recipe.act_dtype]


def _out(quantized: bool, scales: LayerScales | None, name: str, rounding: Rounding, act: FloatOut) -> OutSpec:
    if not quantized:
        return act
    assert scales is not None, f"quantized output needs calibrated scale {name}"
    return QuantOut(getattr(scales, name), rounding)


def build_block(recipe: ModeRecipe, p: LayerParams, scales: LayerScales | None, dims: ModelDims,
                layer: int) -> EmuMambaBlock:
    """One block of `recipe` from prepared parameters and the layer's calibrated scales."""
    act = FloatOut(act_dtype(recipe))
    int8_weights = recipe.weights == "int8"
    rotate = recipe.rotate == "yes"
    even, away = Rounding.HALF_EVEN, Rounding.HALF_AWAY
    if int8_weights:
        conv_input = ConvInput("dynamic") if recipe.conv_in == "dynamic" else ConvInput("static", scales.s_xz)
    else:
        conv_input = ConvInput("float")
    s_u = scales.s_u if scales is not None else None
    return EmuMambaBlock(
        layer, dims,
        norm=EmuRMSNorm(p.norm_weight, dims.norm_eps, _out(recipe.norm_out == "int8", scales, "s_in", even, act)),
        in_proj=EmuLinear(p.in_proj, Epilogue.RATIO_THEN_WEIGHT,
                          _out(recipe.in_proj_out == "int8", scales, "s_xz", even, act)),
        conv1d=EmuConv1d(p.conv_weight, p.conv_bias, conv_input,
                         _out(recipe.conv_out == "int8", scales, "s_u", away, FloatOut(torch.float32))),
        x_proj=EmuLinear(p.x_proj, Epilogue.WEIGHT_THEN_RATIO, _out(int8_weights, scales, "s_xp", even, act)),
        dt_proj=EmuLinear(p.dt_proj, Epilogue.RATIO_THEN_WEIGHT, _out(int8_weights, scales, "s_dt", even, act)),
        ssm=EmuSelectiveScan(p.A_log, p.D, p.dt_bias, ScanOrder(recipe.ssm_impl), act),
        had=EmuHadamard(_out(recipe.had_out == "int8", scales, "s_H", away, act)) if rotate else None,
        out_proj=EmuLinear(p.out_proj, Epilogue.WEIGHT_THEN_RATIO, act),
        u_input=UInput(ssm_u=recipe.ssm_u, s_u=s_u, xproj_requant=int8_weights),
    )


def build_backbone(recipe: ModeRecipe, bank: WeightBank, scales: list[LayerScales] | None,
                   depth: int) -> EmuBackbone:
    """Embedding and blocks 0..depth of `recipe`; nothing deeper is read or built."""
    if recipe.needs_calibration and scales is None:
        raise ValueError(f"mode {recipe.name!r} quantizes activations and needs calibrated scales")
    rotate = recipe.rotate == "yes"
    dims = bank.dims
    blocks = [build_block(recipe, bank.layer(i, recipe.weights, rotate), scales[i] if scales else None, dims, i)
              for i in range(depth + 1)]
    dtype = act_dtype(recipe)
    return EmuBackbone(lambda ids: bank.embed(ids, rotate, dtype, recipe.weights), blocks)
