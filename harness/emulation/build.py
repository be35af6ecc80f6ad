"""The one place that turns a mode recipe into emulated modules (docs/spec/modes.md knobs -> module settings).

Rules beyond the knob table, for recipes that mix float and int8 pieces:

* a linear or conv layer runs the int8 kernel when its weights are int8 and its
  input is int8; otherwise it multiplies real values in fp32;
* x_proj and dt_proj outputs are int8 (at s_xp, s_dt) exactly when weights are int8;
* an int8 conv quantizes a float input at s_xz (conv_in=static) or per call
  (conv_in=dynamic); x_proj (int8 weights) quantizes a float conv output at s_u (RNE);
* the online Hadamard exists only with rotate=yes (out_proj absorbed Had_E);
* out_proj's output, the embedding and the float paths use act_dtype; the SSM
  output y is rounded to act_dtype.

``prep`` selects the weights (harness.emulation.weights) and, with them, the op order of the
steps whose order Quamba's own code fixes (prep=exact keeps the harness's own order).
(RMSNorm is the same for both: 1 / sqrt(pairwise sum(r^2) / d_model + eps), ops.portable.)

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
from typing import Protocol

import torch

from ..modes import (BUILTIN_MODES, CALIBRATION_RECIPES, ConvIn, ConvOut, ModeRecipe, NumberFormat, Prep, Rotate,
                     SsmImpl, Store, Weights, XGroups)
from .modules import (
    ConvInput,
    EmuBackbone,
    EmuConv1d,
    EmuHadamard,
    EmuLinear,
    EmuMambaBlock,
    EmuRMSNorm,
    EmuSelectiveScan,
    UInput,
)
from ..kernels.hadamard import quamba_kernel_support
from ..kernels.linear import Epilogue
from ..kernels.scan import ScanOrder
from ..spec import (FLOAT_DTYPES, FORMAT_NAMES, FloatOut, FormatOut, LayerScales, Mamba2Dims, ModelDims, OutSpec,
                    QuantOut, Rounding)
from ..kernels.formats import FORMATS, fake_quantize
from .state import StateRule
from .weights import LayerParams
from .mamba2 import EmuConvXBC, EmuGatedNorm, EmuMamba2Block, EmuSSD
from .weights_mamba2 import Mamba2Params, float_layer_mamba2
from .mamba2_q2 import build_q2_block
from .mamba2_q2w4 import Q2W4Layer, build_q2w4a8_block, with_w4a16_linears
from . import mamba1_w4
from .q2_params import Q2Params, Q2Scales, q2_params
from .q2_head import quantized_rows

assert tuple(f.value for f in NumberFormat)[1:] == FORMAT_NAMES, "modes.NumberFormat must list spec.FORMAT_NAMES"

__all__ = ["build_block", "build_mamba2_block", "build_backbone", "act_dtype", "hadamard_kernel_support", "WeightSource",
           "layer_formats", "build_q2_mamba2_block", "build_q2w4_mamba2_block", "build_q2w4_mamba1_block"]

def act_dtype(recipe: ModeRecipe) -> torch.dtype:
    return FLOAT_DTYPES[recipe.act_dtype]


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
    )


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
    scales; p: the prep=quamba fp16 parameters), emulation.mamba1_w4. ssm_impl=kernel: Quamba's QSScan (W4A8),
    mamba_ssm's selective_scan_fn (W4A16); reference: the fork's reference loop, on the same inputs."""
    kernel = recipe.ssm_impl == SsmImpl.KERNEL
    if w4.scales is not None:
        base = replace(BUILTIN_MODES["0"], ssm_impl=recipe.ssm_impl)
        return mamba1_w4.with_w4a8_linears(build_block(base, p, w4.scales, dims, layer), w4)
    block = build_block(CALIBRATION_RECIPES[Prep.QUAMBA], p, None, dims, layer, calibration=True)
    block.ssm.order = ScanOrder.MAMBA if kernel else ScanOrder.TORCH
    return mamba1_w4.with_w4a16_linears(block, w4)


class WeightSource(Protocol):
    """Where build_backbone takes a mode's weights from (harness.runner.weightbank.WeightBank)."""

    dims: ModelDims

    def layer(self, i: int, weights: str, rotate: bool, prep: str) -> LayerParams: ...

    def embed(self, ids: torch.Tensor, rotate: bool, dtype: torch.dtype, prep: str, weights: str) -> torch.Tensor: ...

    def raw(self, layer: int) -> dict: ...


def build_backbone(recipe: ModeRecipe, bank: WeightSource, scales: list[LayerScales] | list[Q2Scales] | None,
                   depth: int, calibration: bool = False) -> EmuBackbone:
    """Embedding and blocks 0..depth of `recipe`; nothing deeper is read or built."""
    if recipe.needs_calibration and scales is None:
        raise ValueError(f"mode {recipe.name!r} quantizes activations and needs calibrated scales")
    rotate = recipe.rotate == Rotate.YES
    dims = bank.dims
    if dims.architecture == "mamba2" and recipe.prep == Prep.QUAMBA2 and recipe.weights == Weights.INT4:
        given = getattr(bank, "q2_given", lambda _i, _k: None)  # a Quamba2 W4 checkpoint's own tensors
        blocks = [build_q2w4_mamba2_block(recipe, None, scales[i], dims, i, params=p)
                  if (p := given(i, recipe.calibration_key)) is not None
                  else build_q2w4_mamba2_block(recipe, bank.raw(i), scales[i], dims, i) for i in range(depth + 1)]
    elif dims.architecture == "mamba2" and recipe.prep == Prep.QUAMBA2:
        given = getattr(bank, "q2_given", lambda _i: None)  # a Quamba2 checkpoint's own codes (WeightBank.q2_given)
        blocks = [build_q2_mamba2_block(recipe, None, scales[i], dims, i, params=p) if (p := given(i)) is not None
                  else build_q2_mamba2_block(recipe, bank.raw(i), scales[i], dims, i) for i in range(depth + 1)]
    elif dims.architecture == "mamba2":
        blocks = [build_mamba2_block(recipe, bank.layer(i, recipe.weights, rotate, recipe.prep), dims, i)
                  for i in range(depth + 1)]
    elif recipe.weights == Weights.INT4:  # Mamba-1: Quamba2's W4A8QMamba / W4A16QMamba on Quamba1's preparation
        given = getattr(bank, "q2_given", lambda _i, _k: None)  # a W4 Mamba-1 checkpoint's own (checkpoints.quamba1_w4)
        blocks = [build_q2w4_mamba1_block(recipe, p if (p := given(i, recipe.calibration_key)) is not None else
                                          bank.layer(i, "fp16" if scales[i].scales is None else "int8", True,
                                                     Prep.QUAMBA), scales[i], dims, i) for i in range(depth + 1)]
    else:
        blocks = [build_block(recipe.for_layer(i) if recipe.layers else recipe,
                              bank.layer(i, recipe.weights, rotate, recipe.prep), scales[i] if scales else None,
                              dims, i, calibration) for i in range(depth + 1)]
    dtype = act_dtype(recipe)
    if recipe.embedding != "fp16":  # Quamba2's W8O16/W4O16Embedding (emulation.q2_head)
        return EmuBackbone(lambda ids: quantized_rows(bank.embed(ids, rotate, dtype, recipe.prep, recipe.weights),
                                                      str(recipe.embedding)), blocks)
    return EmuBackbone(lambda ids: bank.embed(ids, rotate, dtype, recipe.prep, recipe.weights), blocks)


def hadamard_kernel_support(recipes: list[ModeRecipe], dims: ModelDims) -> dict[str, str | None] | None:
    """For runs with a rotated mode: per rotated width ("d_model", "d_inner"), None when Quamba's
    Hadamard kernels transform it, else why not (ops.hadamard.quamba_kernel_support). The harness
    rotates such widths all the same; the run warns and records it. None when no mode rotates."""
    if not any(r.rotate == Rotate.YES for r in recipes):
        return None
    return {"d_model": quamba_kernel_support(dims.d_model), "d_inner": quamba_kernel_support(dims.d_inner)}
