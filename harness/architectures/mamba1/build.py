"""The Mamba-1 block's knob interpreter: a mode's knobs (docs/spec/modes.md) -> emulated modules.

Rules beyond the knob table, for recipes that mix float and int8 pieces:

* a linear or conv layer runs the int8 kernel when its weights are int8 and its
  input is int8; otherwise it multiplies real values in fp32;
* x_proj and dt_proj outputs are int8 (at s_xp, s_dt) exactly when weights are int8;
* an int8 conv quantizes a float input at s_xz (conv_in=static) or per call
  (conv_in=dynamic); x_proj (int8 weights) quantizes a float conv output at s_u (RNE);
* the online Hadamard exists only with rotate=yes (out_proj absorbed Had_E);
* out_proj's output, the embedding and the float paths use act_dtype; the SSM
  output y is rounded to act_dtype.

``prep`` selects the weights (harness.architectures.mamba1.weights) and, with them, the op order of the
steps whose order Quamba's own code fixes (prep=exact keeps the harness's own order).
(RMSNorm is the same for both: 1 / sqrt(pairwise sum(r^2) / d_model + eps), kernels.portable.)

============================  ===============================  ==============================
step                          prep=quamba                      prep=exact
============================  ===============================  ==============================
reference-order scan          ScanOrder.TORCH (fork's loop)    ScanOrder.REFERENCE
in_proj with a float output   W8A8B16O16 `forward` epilogue:   RATIO_THEN_WEIGHT
                              WEIGHT_THEN_RATIO                (in_proj's int8 order)
Hadamard (online and float)   kernel fp32 butterflies          exact, rounded once
============================  ===============================  ==============================

The calibration model of prep=quamba (``calibration=True``) is Quamba's fp16 model:
conv output stored fp16 before SiLU and SiLU output fp16 (qMambaLayer.py:105-106),
and mamba_ssm's scan (ScanOrder.MAMBA).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ...emulation.build import act_dtype
from ...emulation.modules import (ConvInput, EmuConv1d, EmuHadamard, EmuLinear, EmuMambaBlock, EmuRMSNorm,
                                  EmuSelectiveScan, UInput)
from ...emulation.norms import EmuMixerNorms, EmuWeightlessRMSNorm, bound_scale
from ...emulation.state import StateRule
from ...kernels.formats import FORMATS, fake_quantize
from ...kernels.linear import Epilogue
from ...kernels.scan import ScanOrder
from ...modes import ConvIn, ConvOut, ModeRecipe, NumberFormat, Prep, Rotate, SsmImpl, Store, Weights
from ...spec import FloatOut, FormatOut, LayerScales, ModelDims, OutSpec, QuantOut, Rounding
from .weights import LayerParams

__all__ = ["build_block", "build_blocks", "layer_formats", "mixer_norms"]


def _out(quantized: bool, scales: LayerScales | None, name: str, rounding: Rounding, act: FloatOut) -> OutSpec:
    if not quantized:
        return act
    assert scales is not None, f"quantized output needs calibrated scale {name}"
    return QuantOut(getattr(scales, name), rounding)


def _fits(fmt: str, width: int) -> bool:
    return not FORMATS[fmt].block or width % FORMATS[fmt].block == 0


def _fmt_out(recipe: ModeRecipe, width: int, otherwise: OutSpec) -> OutSpec:
    """act_format at an activation point of `width` channels; a point whose width is not a multiple of the
    format's block keeps `otherwise` (layer_formats records it)."""
    fmt = recipe.act_format
    return FormatOut(str(fmt)) if fmt != NumberFormat.NONE and _fits(fmt, width) else otherwise


def _format_weights(recipe: ModeRecipe, p: LayerParams) -> LayerParams:
    """weight_format on the four linear weights (groups along in-features); a weight whose in-features are
    not a multiple of the block stays as it is (layer_formats records it)."""
    fmt = recipe.weight_format
    if fmt == NumberFormat.NONE:
        return p
    return replace(p, **{name: fake_quantize(getattr(p, name), fmt) for name in _LINEARS
                         if _fits(fmt, getattr(p, name).shape[-1])})


_LINEARS = ("in_proj", "x_proj", "dt_proj", "out_proj")


def layer_formats(recipe: ModeRecipe, dims: ModelDims, depth: int) -> dict[str, dict]:
    """What each block ran, for the stats: its format knobs, and the points and weights a format could not
    take (their width is not a multiple of its block), which kept the recipe's own arithmetic."""
    out = {}
    widths = {"norm.out": dims.d_model, "in_proj.out": 2 * dims.d_inner, "conv1d.out": dims.d_inner,
              "x_proj.out": dims.dt_rank + 2 * dims.d_state, "dt_proj.out": dims.d_inner,
              "out_proj.in": dims.d_inner}
    ins = {"in_proj": dims.d_model, "x_proj": dims.d_inner, "dt_proj": dims.dt_rank, "out_proj": dims.d_inner}
    for i in range(depth + 1):
        r = recipe.for_layer(i)
        row = {k: str(getattr(r, k)) for k in ("weight_format", "act_format", "state_format")}
        kept = []
        if r.act_format != NumberFormat.NONE:
            kept += [p for p, w in widths.items() if not _fits(r.act_format, w)]
        if r.state_format != NumberFormat.NONE and not _fits(r.state_format, dims.d_inner):
            kept.append("ssm.state")
        if r.weight_format != NumberFormat.NONE:
            kept += [f"{n}.weight" for n, w in ins.items() if not _fits(r.weight_format, w)]
        out[str(i)] = {**row, "kept": kept}
    return out


def mixer_norms(recipe: ModeRecipe, dims: ModelDims, int8: bool, act: FloatOut) -> EmuMixerNorms | None:
    """A Falcon-Mamba block's dt, B and C norms (dims.mixer_rms_eps; None for plain Mamba-1). Their outputs
    take what x_proj's output takes: int8 when x_proj's is (the W8A8 recipes: re-quantized at the norm's
    bound sqrt(width) / 127, emulation.norms, RNE as x_proj's own output), else act_dtype or act_format."""
    eps = getattr(dims, "mixer_rms_eps", None)
    if eps is None:
        return None

    def norm(width: int) -> EmuWeightlessRMSNorm:
        out = QuantOut(bound_scale(width), Rounding.HALF_EVEN) if int8 else _fmt_out(recipe, width, act)
        return EmuWeightlessRMSNorm(eps, out)

    return EmuMixerNorms(norm(dims.dt_rank), norm(dims.d_state), norm(dims.d_state))


def _scan_order(recipe: ModeRecipe, calibration: bool) -> ScanOrder:
    if recipe.prep == Prep.EXACT:
        return ScanOrder(recipe.ssm_impl)
    if calibration:
        return ScanOrder.MAMBA
    return ScanOrder.KERNEL if recipe.ssm_impl == SsmImpl.KERNEL else ScanOrder.TORCH


def _state_rule(recipe: ModeRecipe, scales: LayerScales | None) -> StateRule:
    """The decode step's SSM state (docs/decode.md): int8 at s_h in the W8A8 step (weights=int8, Quamba's int8
    cache), Quamba's Triton update with ssm_impl=kernel; a float recipe keeps it in act_dtype."""
    int8 = recipe.weights == Weights.INT8 and scales is not None
    return StateRule(scales.s_h if int8 else None, act_dtype(recipe), recipe.ssm_impl == SsmImpl.KERNEL)


def build_block(recipe: ModeRecipe, p: LayerParams, scales: LayerScales | None, dims: ModelDims,
                layer: int, calibration: bool = False) -> EmuMambaBlock:
    """One block of `recipe` from prepared parameters and the layer's calibrated scales.

    calibration: build the calibration model of the recipe's prep (module docstring).
    """
    act = FloatOut(act_dtype(recipe))
    p = _format_weights(recipe, p)
    if recipe.state_format != NumberFormat.NONE and not _fits(recipe.state_format, dims.d_inner):
        recipe = replace(recipe, state_format="none")
    int8_weights = recipe.weights == Weights.INT8
    rotate = recipe.rotate == Rotate.YES
    quamba = recipe.prep == Prep.QUAMBA
    even, away = Rounding.HALF_EVEN, Rounding.HALF_AWAY
    if int8_weights:
        conv_input = ConvInput("dynamic") if recipe.conv_in == ConvIn.DYNAMIC else ConvInput("static", scales.s_xz)
    else:
        conv_input = ConvInput("float")
    conv_out = _fmt_out(recipe, dims.d_inner, _out(recipe.conv_out == ConvOut.INT8, scales, "s_u", away,
                                                   FloatOut(torch.float32)))
    pre_silu = None
    if calibration and quamba:  # fp16 nn.Conv1d, then fp16 SiLU (qMambaLayer.py:105-106)
        conv_out, pre_silu = FloatOut(torch.float16), torch.float16
    # mode 3's float-output in_proj: W8A8B16O16Linear.forward applies the weight scale first
    # (qLinearLayer.py:806-820, cutlass_scaled_mm_dq(y, x, W, a, b) as out_proj)
    in_order = Epilogue.WEIGHT_THEN_RATIO if quamba and recipe.in_proj_out == Store.FP else Epilogue.RATIO_THEN_WEIGHT
    s_u = scales.s_u if scales is not None else None
    return EmuMambaBlock(
        layer, dims,
        norm=EmuRMSNorm(p.norm_weight, dims.norm_eps, _fmt_out(recipe, dims.d_model, _out(
            recipe.norm_out == Store.INT8, scales, "s_in", even, act))),
        in_proj=EmuLinear(p.in_proj, in_order, _fmt_out(recipe, 2 * dims.d_inner, _out(
            recipe.in_proj_out == Store.INT8, scales, "s_xz", even, act))),
        conv1d=EmuConv1d(p.conv_weight, p.conv_bias, conv_input, conv_out, pre_silu),
        x_proj=EmuLinear(p.x_proj, Epilogue.WEIGHT_THEN_RATIO, _fmt_out(recipe, dims.dt_rank + 2 * dims.d_state, _out(
            int8_weights, scales, "s_xp", even, act))),
        dt_proj=EmuLinear(p.dt_proj, Epilogue.RATIO_THEN_WEIGHT, _fmt_out(recipe, dims.d_inner, _out(
            int8_weights, scales, "s_dt", even, act))),
        ssm=EmuSelectiveScan(p.A_log, p.D, p.dt_bias, _scan_order(recipe, calibration),
                             act if rotate else _fmt_out(recipe, dims.d_inner, act),  # no Hadamard: out_proj's input
                             state_rule=_state_rule(recipe, scales),
                             state_fmt=None if recipe.state_format == NumberFormat.NONE else str(recipe.state_format)),
        had=EmuHadamard(_fmt_out(recipe, dims.d_inner, _out(recipe.had_out == Store.INT8, scales, "s_H", away, act)),
                        fht=quamba) if rotate else None,
        out_proj=EmuLinear(p.out_proj, Epilogue.WEIGHT_THEN_RATIO, act),
        u_input=UInput(ssm_u=recipe.ssm_u, s_u=s_u, xproj_requant=int8_weights),
        mixer_norms=mixer_norms(recipe, dims, int8_weights, act),
    )


def build_blocks(recipe: ModeRecipe, bank, scales: list[LayerScales] | None, depth: int,
                 calibration: bool = False) -> list[EmuMambaBlock]:
    """Blocks 0..depth of `recipe` from the bank's prepared weights (``layers``: block i runs recipe.for_layer(i))."""
    rotate = recipe.rotate == Rotate.YES
    return [build_block(recipe.for_layer(i) if recipe.layers else recipe,
                        bank.layer(i, recipe.weights, rotate, recipe.prep), scales[i] if scales else None,
                        bank.dims, i, calibration) for i in range(depth + 1)]
