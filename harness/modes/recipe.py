"""ModeRecipe: one mode as knob values, checked for consistency when it is made."""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace
from enum import StrEnum

from .knobs import (FORMAT_KNOBS, KNOB_TYPES, KNOBS, PRESETS, ActDtype, ConvIn, ConvOut, ModeError, NumberFormat, Prep,
                    Rotate, SsmImpl, SsmU, Store, Weights, parse_layer_range)
from .knobs import Q2_KNOB_TYPES, Q2_KNOBS, StateDtype, XGroups
from .knobs import Q2_HEAD_KNOB_TYPES, Q2_HEAD_KNOBS, Embedding, LmHead

__all__ = ["ModeRecipe"]

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.+-]*$")


@dataclass(frozen=True)
class ModeRecipe:
    """One mode: a name, a descriptive title and a value for every knob."""

    name: str
    title: str
    weights: Weights
    rotate: Rotate
    norm_out: Store
    in_proj_out: Store
    conv_in: ConvIn
    conv_out: ConvOut
    ssm_u: SsmU
    ssm_impl: SsmImpl
    had_out: Store
    act_dtype: ActDtype
    prep: Prep
    weight_format: NumberFormat = NumberFormat.NONE
    act_format: NumberFormat = NumberFormat.NONE
    state_format: NumberFormat = NumberFormat.NONE
    # per-layer format knobs: ((layer range, ((knob, value), ...)), ...), e.g. from {"0-3": {...}, "4-": {...}}
    layers: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()
    # Quamba2's variant knobs (knobs.Q2_KNOBS; prep=quamba2 only)
    x_groups: XGroups = XGroups.GROUPED
    state_dtype: StateDtype = StateDtype.INT8
    # Quamba2's quantized embedding and lm_head (knobs.Q2_HEAD_KNOBS; prep=quamba2 only)
    embedding: Embedding = Embedding.FP16
    lm_head: LmHead = LmHead.FP16
    # the recipe family that runs the mode (harness.recipes.registry); "" for the built-in families, which own a
    # mode by its knobs. A plugin's modes name their family.
    family: str = ""
    # a family's own settings, ((name, value), ...) as strings (a dict is accepted): e.g. SmQ-SSM's alpha
    # (harness.recipes.smq); the family checks them (Recipe.mode_problem)
    options: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", _options_value(self.name, self.options))
        if not _NAME_RE.match(self.name) or self.name in PRESETS:
            raise ModeError(f"invalid mode name {self.name!r}: use letters, digits, '.', '+' and '-' "
                            f"(no '_'), not starting with a symbol, and not a preset name ({', '.join(PRESETS)})")
        for knob, allowed in KNOBS.items():
            value = getattr(self, knob)
            if value not in allowed:
                raise ModeError(f"mode {self.name!r}: knob {knob}={value!r} is not valid; "
                                f"valid values: {', '.join(allowed)}")
            object.__setattr__(self, knob, KNOB_TYPES[knob](value))  # frozen: the member, set once here
        for knob in FORMAT_KNOBS:
            object.__setattr__(self, knob, _format_value(self.name, knob, getattr(self, knob)))
        object.__setattr__(self, "layers", _layers_value(self.name, self.layers))
        for knob, allowed in {**Q2_KNOBS, **Q2_HEAD_KNOBS}.items():
            if getattr(self, knob) not in allowed:
                raise ModeError(f"mode {self.name!r}: knob {knob}={getattr(self, knob)!r} is not valid; "
                                f"valid values: {', '.join(allowed)}")
            object.__setattr__(self, knob, {**Q2_KNOB_TYPES, **Q2_HEAD_KNOB_TYPES}[knob](getattr(self, knob)))
        for problem in _inconsistencies(self):
            raise ModeError(f"mode {self.name!r}: {problem}")

    def knobs(self) -> dict[str, StrEnum]:
        """Every knob; the format knobs, the per-layer table and Quamba2's variant knobs only where set (the stats'
        "recipe")."""
        knobs = {k: getattr(self, k) for k in KNOBS}
        knobs.update({k: getattr(self, k) for k in FORMAT_KNOBS if getattr(self, k) != NumberFormat.NONE})
        if self.layers:
            knobs["layers"] = {r: dict(kv) for r, kv in self.layers}
        knobs.update({k: getattr(self, k) for k, allowed in Q2_KNOBS.items() if getattr(self, k) != allowed[0]})
        knobs.update({k: getattr(self, k) for k, allowed in Q2_HEAD_KNOBS.items() if getattr(self, k) != allowed[0]})
        if self.family:
            knobs["family"] = self.family
        if self.options:
            knobs["options"] = dict(self.options)
        return knobs

    def option(self, name: str, default: str) -> str:
        """The value of option `name` (Recipe.mode_problem checks the values), or `default`."""
        return dict(self.options).get(name, default)

    def for_layer(self, i: int) -> "ModeRecipe":
        """The recipe block i runs: the format knobs of every `layers` range holding i applied in order."""
        values = {}
        for text, kv in self.layers:
            lo, hi = parse_layer_range(text)
            if lo <= i and (hi is None or i <= hi):
                values.update(kv)
        return replace(self, layers=(), **values) if values else replace(self, layers=())

    def check_layers(self, n_layer: int) -> None:
        """Every `layers` range names some block of a model of n_layer blocks; ModeError naming it otherwise
        (a range past the last block would apply to nothing, silently)."""
        for text, _ in self.layers:
            if parse_layer_range(text)[0] >= n_layer:
                raise ModeError(f"mode {self.name!r}: layers range {text!r} names no block of the model, which has "
                                f"{n_layer} blocks (valid: ranges within 0..{n_layer - 1}, e.g. '0-{n_layer - 1}' "
                                f"or '{n_layer - 1}-')")

    @property
    def has_formats(self) -> bool:
        return bool(self.layers) or any(getattr(self, k) != NumberFormat.NONE for k in FORMAT_KNOBS)

    @property
    def calibration_key(self) -> str:
        """Which calibration the recipe reads (one per key in a run): its prep, or for Quamba2's int4 recipes
        "quamba2-w4a8" (the W8A8 scales plus GPTQ; on Mamba-2 of the reordered model) or "quamba2-w4a16" (GPTQ
        only)."""
        if self.weights == Weights.INT4:  # prep=quamba2, or prep=quamba on Mamba-1 (on_architecture)
            return "quamba2-w4a8" if self.norm_out == Store.INT8 else "quamba2-w4a16"
        return str(self.prep)

    def as_dict(self) -> dict[str, str]:
        return asdict(self)

    @property
    def needs_calibration(self) -> bool:
        """True when any activation is quantized, i.e. the recipe reads calibrated scales."""
        return (self.weights in (Weights.INT8, Weights.INT4) or self.norm_out == Store.INT8 or self.in_proj_out == Store.INT8
                or self.conv_out == ConvOut.INT8 or self.ssm_u in (SsmU.INT8, SsmU.GRID, SsmU.REQUANT) or self.had_out == Store.INT8)


def _options_value(mode: str, options: object) -> tuple[tuple[str, str], ...]:
    """{"alpha": 0.5} or its tuple form -> (("alpha", "0.5"),), sorted by name; a ModeError for anything else."""
    items = options.items() if isinstance(options, dict) else options
    try:
        pairs = [(k, v) for k, v in items]
    except (TypeError, ValueError):
        raise ModeError(f"mode {mode!r}: options must map option names to values") from None
    bad = [k for k, v in pairs if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (str, int, float))]
    if bad:
        raise ModeError(f"mode {mode!r}: options must map names to strings or numbers ({', '.join(map(str, bad))})")
    return tuple(sorted((k, str(v)) for k, v in pairs))


def _format_value(mode: str, knob: str, value: object) -> NumberFormat:
    if value not in {f.value for f in NumberFormat}:
        raise ModeError(f"mode {mode!r}: knob {knob}={value!r} is not valid; valid values: "
                        f"{', '.join(f.value for f in NumberFormat)}")
    return NumberFormat(value)


def _layers_value(mode: str, layers: object) -> tuple:
    """{"0-3": {"act_format": "bf16"}, ...} or its tuple form -> the tuple form, every range and knob checked."""
    items = layers.items() if isinstance(layers, dict) else layers
    if not isinstance(items, (tuple, list, type({}.items()))):
        raise ModeError(f"mode {mode!r}: layers must map layer ranges to tables of format knobs")
    out = []
    for entry in items:
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2):
            raise ModeError(f"mode {mode!r}: layers must map layer ranges to tables of format knobs")
        text, kv = entry
        parse_layer_range(text)
        kv = kv.items() if isinstance(kv, dict) else kv
        checked = []
        for knob, value in kv:
            if knob not in FORMAT_KNOBS:
                raise ModeError(f"mode {mode!r}: layers[{text!r}] sets {knob!r}; per-layer knobs: {', '.join(FORMAT_KNOBS)}")
            checked.append((knob, str(_format_value(mode, knob, value))))
        out.append((text, tuple(checked)))
    return tuple(out)


# prep=quamba2's fixed knobs (W8A8QMamba2, quamba/qMamba2.py:1071-1334; docs/modes.md "Mamba-2")
_Q2_W8A8 = {"weights": "int8", "rotate": "yes", "norm_out": "int8", "in_proj_out": "int8", "conv_in": "static",
            "conv_out": "int8", "ssm_u": "int8", "had_out": "int8", "act_dtype": "fp16"}
# W4A8QMamba2 (qMamba2.py:735-994): W8A8's activations with GPTQ int4 weights; W4A16QMamba2 (:381-639): fp16
_Q2_RECIPES = (_Q2_W8A8, {**_Q2_W8A8, "weights": "int4"},
               {"weights": "int4", "rotate": "yes", "norm_out": "fp", "in_proj_out": "fp", "conv_in": "static",
                "conv_out": "fp32", "ssm_u": "fp32", "had_out": "fp", "act_dtype": "fp16"})


def _inconsistencies(r: ModeRecipe) -> list[str]:
    out = []
    if r.has_formats and r.needs_calibration:
        out.append("the format knobs (weight_format, act_format, state_format, layers) need a floating-point "
                   "recipe (weights fp32 or fp16, no int8 activation): base the mode on fp32 or 1")
    if r.rotate == Rotate.NO and (r.norm_out == Store.INT8 or r.had_out == Store.INT8):
        out.append("norm_out=int8 and had_out=int8 need rotate=yes: s_in and s_H are calibrated on the "
                   "rotated residual stream, so they do not fit an unrotated model")
    if r.ssm_u in (SsmU.INT8, SsmU.GRID) and r.conv_out != ConvOut.INT8:
        out.append(f"ssm_u={r.ssm_u} needs conv_out=int8 (it takes the conv's int8 codes); "
                   "with conv_out=fp32 use ssm_u=requant or ssm_u=fp32")
    if r.ssm_u in (SsmU.REQUANT, SsmU.FP32) and r.conv_out != ConvOut.FP32:
        out.append(f"ssm_u={r.ssm_u} needs conv_out=fp32 (it takes the true fp32 conv output); "
                   "with conv_out=int8 use ssm_u=int8 or ssm_u=grid")
    if r.prep == Prep.QUAMBA and r.weights == Weights.FP32:
        out.append("prep=quamba needs weights=fp16 or int8: Quamba prepares its weights in fp16; "
                   "use prep=exact for fp32 weights")
    if r.prep == Prep.QUAMBA2 and not any(all(str(getattr(r, k)) == v for k, v in fixed.items()) for fixed in _Q2_RECIPES):
        out.append("prep=quamba2 is Quamba2's W8A8 recipe (or its W4A8, W4A16 ones): it needs "
                   + "; or ".join(" ".join(f"{k}={v}" for k, v in fixed.items()) for fixed in _Q2_RECIPES)
                   + " (ssm_impl kernel or reference)")
    w4_rows = _Q2_RECIPES[1:]
    if r.weights == Weights.INT4 and r.prep not in (Prep.QUAMBA2, Prep.QUAMBA):
        out.append("weights=int4 is Quamba2's GPTQ (q2-w4a8, q2-w4a16): it needs prep=quamba2")
    if r.weights == Weights.INT4 and r.prep == Prep.QUAMBA and \
            not any(all(str(getattr(r, k)) == v for k, v in fixed.items()) for fixed in w4_rows):
        out.append("weights=int4 with prep=quamba is q2-w4a8 or q2-w4a16 on a Mamba-1 model: it needs "
                   + "; or ".join(" ".join(f"{k}={v}" for k, v in fixed.items()) for fixed in w4_rows))
    changed = [f"{k}={getattr(r, k)}" for k, v in Q2_KNOBS.items() if getattr(r, k) != v[0]]
    if r.prep != Prep.QUAMBA2 and changed:
        out.append(f"{' and '.join(changed)} apply to Quamba2's W8A8 only (prep=quamba2, base q2-w8a8, Mamba-2): "
                   f"this recipe (prep={r.prep}) has no grouped x scales or Quamba2 state to change; "
                   f"use {' '.join(f'{k}={v[0]}' for k, v in Q2_KNOBS.items())}")
    if r.weights == Weights.INT4 and changed:
        out.append(f"{' and '.join(changed)} apply to q2-w8a8's block only; the W4 recipes (weights=int4) keep "
                   f"{' '.join(f'{k}={v[0]}' for k, v in Q2_KNOBS.items())}")
    head = [f"{k}={getattr(r, k)}" for k, v in Q2_HEAD_KNOBS.items() if getattr(r, k) != v[0]]
    if r.prep != Prep.QUAMBA2 and head:
        out.append(f"{' and '.join(head)} are Quamba2's quantized embedding/lm_head (prep=quamba2: q2-w8a8, q2-w4a8, "
                   f"q2-w4a16 on Mamba-2): this recipe (prep={r.prep}) keeps them in floating point; use "
                   f"{' '.join(f'{k}={v[0]}' for k, v in Q2_HEAD_KNOBS.items())}")
    if r.conv_in == ConvIn.DYNAMIC and r.weights != Weights.INT8:
        out.append("conv_in=dynamic needs weights=int8: only the int8 conv quantizes its input")
    return out
