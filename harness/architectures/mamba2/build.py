"""The Mamba-2 block of a float recipe (modes.MAMBA2_KNOBS say which knobs apply), and the number formats
(docs/formats.md "Formats in recipes": weight_format, act_format and their per-layer tables; state_format is a
Mamba-1 knob only, the chunked SSD has no per-step state to round)."""
from __future__ import annotations

from dataclasses import replace

from ...emulation.build import act_dtype, fits_format, format_out, format_weight
from ...emulation.modules import EmuHadamard, EmuLinear, EmuRMSNorm
from ...emulation.state import StateRule
from ...kernels.linear import Epilogue
from ...modes import ModeRecipe, NumberFormat, Rotate, SsmImpl
from ...spec import FloatOut, Mamba2Dims, SplitOut
from .block import EmuConvXBC, EmuGatedNorm, EmuMamba2Block, EmuSSD
from .weights import Mamba2Params

__all__ = ["build_mamba2_block", "build_blocks", "mamba2_layer_formats", "FORMAT_KNOBS"]

FORMAT_KNOBS = ("weight_format", "act_format")  # the format knobs a Mamba-2 block applies (Architecture.extra)


def _split(recipe: ModeRecipe, widths: list[int], act: FloatOut):
    """act_format on each part of a split output (in_proj's z | xBC | dt, the conv's x | B | C: the points Quamba2's
    W8A8 quantizes each at its own scale); act alone without a format."""
    if recipe.act_format == NumberFormat.NONE:
        return act
    return SplitOut(tuple(widths), tuple(format_out(recipe, w, act) for w in widths))


def _widths(dims: Mamba2Dims) -> dict[str, int]:
    """The activation points act_format rounds, and their widths."""
    gs = dims.ngroups * dims.d_state
    return {"norm.out": dims.d_model, "in_proj.z": dims.d_inner, "in_proj.xBC": dims.conv_dim,
            "in_proj.dt": dims.nheads, "conv1d.x": dims.d_inner, "conv1d.B": gs, "conv1d.C": gs,
            "out_proj.in": dims.d_inner}


def build_mamba2_block(recipe: ModeRecipe, p: Mamba2Params, dims: Mamba2Dims, layer: int) -> EmuMamba2Block:
    """One Mamba-2 block of a float recipe (modes.MAMBA2_KNOBS says which knobs apply): every op in fp32
    arithmetic, each output rounded to act_dtype; ssm_impl=kernel is the chunked SSD (as the kernels and
    transformers compute it), reference the token-by-token recurrence; rotate=yes rotates the residual
    stream and adds the online Hadamard after the gated norm (weights_mamba2). weight_format rounds in_proj and
    out_proj; act_format the points of _widths (out_proj's input: the Hadamard's output with rotate=yes, the gated
    norm's without)."""
    act = FloatOut(act_dtype(recipe))
    gs = dims.ngroups * dims.d_state
    rotate = recipe.rotate == Rotate.YES
    if recipe.weight_format != NumberFormat.NONE:
        p = replace(p, in_proj=format_weight(recipe, p.in_proj), out_proj=format_weight(recipe, p.out_proj))
    return EmuMamba2Block(
        layer, dims,
        norm=EmuRMSNorm(p.norm_weight, dims.norm_eps, format_out(recipe, dims.d_model, act)),
        in_proj=EmuLinear(p.in_proj, Epilogue.RATIO_THEN_WEIGHT,
                          _split(recipe, [dims.d_inner, dims.conv_dim, dims.nheads], act)),
        conv1d=EmuConvXBC(p.conv_weight, p.conv_bias, _split(recipe, [dims.d_inner, gs, gs], act)),
        dt_bias=p.dt_bias,
        ssd=EmuSSD(dims, p.A_log, p.D, p.dt_bias, recipe.ssm_impl == SsmImpl.KERNEL, act,
                   StateRule(None, act_dtype(recipe))),
        gnorm=EmuGatedNorm(p.gnorm_weight, dims.ngroups, dims.gnorm_eps,
                           act if rotate else format_out(recipe, dims.d_inner, act)),
        had=EmuHadamard(format_out(recipe, dims.d_inner, act)) if rotate else None,
        out_proj=EmuLinear(p.out_proj, Epilogue.WEIGHT_THEN_RATIO, act),
    )


def build_blocks(recipe: ModeRecipe, bank, scales, depth: int, calibration: bool = False) -> list[EmuMamba2Block]:
    """Blocks 0..depth of a float recipe on Mamba-2 (no calibrated scales: none of its ops quantizes; ``layers``:
    block i runs recipe.for_layer(i))."""
    rotate = recipe.rotate == Rotate.YES
    return [build_mamba2_block(recipe.for_layer(i) if recipe.layers else recipe,
                               bank.layer(i, recipe.weights, rotate, recipe.prep), bank.dims, i)
            for i in range(depth + 1)]


def mamba2_layer_formats(recipe: ModeRecipe, dims: Mamba2Dims, layer: int) -> dict:
    """What block `layer` ran under the format knobs, for the stats (as architectures.mamba1.build.layer_formats):
    its knobs and the points and weights whose width the format's block does not divide (kept in act_dtype)."""
    r = recipe.for_layer(layer)
    kept = []
    if r.act_format != NumberFormat.NONE:
        kept += [pt for pt, w in _widths(dims).items() if not fits_format(r.act_format, w)]
    if r.weight_format != NumberFormat.NONE:
        kept += [f"{n}.weight" for n, w in (("in_proj", dims.d_model), ("out_proj", dims.d_inner))
                 if not fits_format(r.weight_format, w)]
    return {**{k: str(getattr(r, k)) for k in ("weight_format", "act_format", "state_format")}, "kept": kept}
