"""A hybrid's blocks for a float recipe: the Mamba-2 blocks are Mamba-2's own (its knob interpreter, asked through
the registry: ``Architecture.extra["block"]``), the attention and MLP blocks this folder's (block.py), every op in
fp32 with its output stored in act_dtype; rotate=yes rotates the residual stream (weights.py).

The number formats apply to **every linear** of a hybrid, not only the Mamba-2 blocks': weight_format rounds q/k/v/o
and gate/up/down (groups along in-features) as it rounds in_proj and out_proj, act_format each linear's input, the
points the W8A8 linear recipe quantizes (norm.out, attn.out = o_proj's input, mlp.hidden = down_proj's input;
recipes.quamba.q2.linear). The KV cache, q, k, v and the softmax keep act_dtype (a KV format is the -kvfp8 mode's
knob); a width the format's block does not divide keeps act_dtype and is listed in the stats' ``kept``."""
from __future__ import annotations

from ...emulation.build import act_dtype, fits_format, format_out, format_weight
from ...emulation.modules import EmuLinear, EmuRMSNorm
from ...kernels.linear import Epilogue
from ...modes import ModeRecipe, NumberFormat, Rotate
from ...spec import FloatOut, FormatOut, HybridDims, OutSpec, QuantOut, Rounding
from ..registry import get_architecture
from .block import EmuAttentionBlock, EmuMLPBlock
from .config import ATTENTION, MLP, SSM
from .weights import AttentionParams, MLPParams, attention_layer, mlp_layer, per_channel_int8

__all__ = ["build_blocks", "build_block", "float_block", "w8a8_block", "is_ssm_block", "SSM_BLOCKS",
           "hybrid_layer_formats"]

SSM_BLOCKS = "mamba2"  # the architecture whose blocks a hybrid's SSM layers are


def _linear(w, act: FloatOut) -> EmuLinear:
    return EmuLinear(w, Epilogue.RATIO_THEN_WEIGHT, act)


def _attention(r: ModeRecipe, p: AttentionParams, dims: HybridDims, layer: int, act: FloatOut) -> EmuAttentionBlock:
    w = lambda t: format_weight(r, t)  # noqa: E731
    return EmuAttentionBlock(layer, dims, norm=EmuRMSNorm(p.norm_weight, dims.norm_eps, format_out(r, dims.d_model, act)),
                             q_proj=_linear(w(p.q_proj), act), k_proj=_linear(w(p.k_proj), act),
                             v_proj=_linear(w(p.v_proj), act), o_proj=_linear(w(p.o_proj), act), out=act,
                             mid=format_out(r, dims.n_heads * dims.head_dim, act))


def _mlp(r: ModeRecipe, p: MLPParams, dims: HybridDims, layer: int, act: FloatOut) -> EmuMLPBlock:
    w = lambda t: format_weight(r, t)  # noqa: E731
    return EmuMLPBlock(layer, dims, norm=EmuRMSNorm(p.norm_weight, dims.norm_eps, format_out(r, dims.d_model, act)),
                       gate_proj=None if p.gate_proj is None else _linear(w(p.gate_proj), act),
                       up_proj=_linear(w(p.up_proj), act), down_proj=_linear(w(p.down_proj), act), out=act,
                       mid=format_out(r, dims.d_ff, act))


def build_block(recipe: ModeRecipe, params, dims: HybridDims, layer: int):
    """Block `layer` of a float recipe from its prepared weights (its kind: dims.kinds[layer]); the number formats
    as the module docstring says."""
    act = FloatOut(act_dtype(recipe))
    kind = dims.kinds[layer]
    if kind == ATTENTION:
        return _attention(recipe, params, dims, layer, act)
    if kind == MLP:
        return _mlp(recipe, params, dims, layer, act)
    return get_architecture(SSM_BLOCKS).extra["block"](recipe, params, dims.ssm_dims(), layer)


def build_blocks(recipe: ModeRecipe, bank, scales, depth: int, calibration: bool = False) -> list:
    """Blocks 0..depth of a float recipe (no calibrated scales: none of its ops quantizes; ``layers``: block i runs
    recipe.for_layer(i))."""
    rotate = recipe.rotate == Rotate.YES
    return [build_block(recipe.for_layer(i) if recipe.layers else recipe,
                        bank.layer(i, recipe.weights, rotate, recipe.prep), bank.dims, i) for i in range(depth + 1)]


def hybrid_layer_formats(recipe: ModeRecipe, dims: HybridDims, layer: int) -> dict:
    """What block `layer` ran under the format knobs, for the stats: a Mamba-2 block's as Mamba-2 records it, an
    attention or MLP block's knobs and the points and weights whose width the format's block does not divide."""
    if dims.kinds[layer] == SSM:
        return get_architecture(SSM_BLOCKS).extra["layer_formats"](recipe, dims.ssm_dims(), layer)
    r = recipe.for_layer(layer)
    heads = dims.n_heads * dims.head_dim
    if dims.kinds[layer] == ATTENTION:
        points, ins = {"norm.out": dims.d_model, "attn.out": heads}, {"q_proj": dims.d_model, "k_proj": dims.d_model,
                                                                      "v_proj": dims.d_model, "o_proj": heads}
    else:
        points, ins = {"norm.out": dims.d_model, "mlp.hidden": dims.d_ff}, {"up_proj": dims.d_model,
                                                                            "down_proj": dims.d_ff}
    kept = []
    if r.act_format != NumberFormat.NONE:
        kept += [pt for pt, w in points.items() if not fits_format(r.act_format, w)]
    if r.weight_format != NumberFormat.NONE:
        kept += [f"{n}.weight" for n, w in ins.items() if not fits_format(r.weight_format, w)]
    return {**{k: str(getattr(r, k)) for k in ("weight_format", "act_format", "state_format")}, "kept": kept}


def is_ssm_block(dims, layer: int) -> bool:
    """Whether block `layer` is a Mamba-2 block (every block of a model that is not a hybrid)."""
    kinds = getattr(dims, "kinds", None)
    return kinds is None or kinds[layer] == SSM


def float_block(recipe: ModeRecipe, raw: dict, dims: HybridDims, layer: int):
    """An attention or MLP block of a float recipe straight from its checkpoint tensors (the recipes that quantize
    the Mamba-2 blocks keep these in floating point: recipes.quamba.q2.hybrid)."""
    prepare = attention_layer if dims.kinds[layer] == ATTENTION else mlp_layer
    return build_block(recipe, prepare(raw, recipe.rotate == Rotate.YES, act_dtype(recipe)), dims, layer)


def _kv_out(kv: str, scale: float | None, act: FloatOut) -> OutSpec:
    if kv == "int8":
        return QuantOut(scale, Rounding.HALF_EVEN)
    return act if kv == "fp16" else FormatOut(kv)


def w8a8_block(recipe: ModeRecipe, raw: dict, dims: HybridDims, layer: int, scales, kv: str = "fp16"):
    """An attention or MLP block under the W8A8 linear recipe (recipes.quamba.q2.linear): the weights of `recipe`
    (rotated fp16) on their per-channel int8 grid, each linear's input int8 at its static scale (scales.s_in at the
    RMSNorm's output, scales.s_mid at o_proj's or down_proj's input; RNE), every other output in act_dtype, and the
    KV cache in `kv` ("fp16", "int8" at scales.s_k / s_v, or a number format such as "fp8_e4m3")."""
    act = FloatOut(act_dtype(recipe))
    q8 = lambda s: QuantOut(s, Rounding.HALF_EVEN)  # noqa: E731
    lin = lambda w: _linear(per_channel_int8(w), act)  # noqa: E731
    rotate = recipe.rotate == Rotate.YES
    norm = lambda w: EmuRMSNorm(w, dims.norm_eps, q8(scales.s_in))  # noqa: E731
    if dims.kinds[layer] == ATTENTION:
        p = attention_layer(raw, rotate, act_dtype(recipe))
        return EmuAttentionBlock(layer, dims, norm=norm(p.norm_weight), q_proj=lin(p.q_proj), k_proj=lin(p.k_proj),
                                 v_proj=lin(p.v_proj), o_proj=lin(p.o_proj), out=act, mid=q8(scales.s_mid),
                                 kv=(_kv_out(kv, scales.s_k, act), _kv_out(kv, scales.s_v, act)))
    p = mlp_layer(raw, rotate, act_dtype(recipe))
    return EmuMLPBlock(layer, dims, norm=norm(p.norm_weight), up_proj=lin(p.up_proj),
                       gate_proj=None if p.gate_proj is None else lin(p.gate_proj),
                       down_proj=lin(p.down_proj), out=act, mid=q8(scales.s_mid))
