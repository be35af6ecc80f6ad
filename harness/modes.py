"""Modes as data: the knobs of docs/spec/modes.md, the built-in recipes, presets and user mode files.

A ``ModeRecipe`` holds knob values only; ``harness.emulation.build`` is the single place
that turns a recipe into emulated modules. Built-in modes are entries of the
same registry that ``--modes_file`` extends.
"""
from __future__ import annotations

import json
import re
import tomllib
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from pathlib import Path

__all__ = [
    "KNOBS",
    "KNOB_TYPES",
    "Weights",
    "Rotate",
    "Store",
    "ConvIn",
    "ConvOut",
    "SsmU",
    "SsmImpl",
    "ActDtype",
    "Prep",
    "ModeRecipe",
    "BUILTIN_MODES",
    "PRESETS",
    "ModeError",
    "get_mode",
    "list_modes",
    "ModeRegistry",
    "resolve_modes",
    "load_modes_file",
    "CALIBRATION_RECIPES",
    "NumberFormat",
    "FORMAT_KNOBS",
    "parse_layer_range",
    "MAMBA2_PRESETS",
    "architecture_problem",
]


class ModeError(ValueError):
    """A mode name, knob or mode file is invalid; the message lists what is valid."""


# knob -> allowed values (docs/spec/modes.md "The knobs")
KNOBS: dict[str, tuple[str, ...]] = {
    "weights": ("fp32", "fp16", "int8"),
    "rotate": ("yes", "no"),
    "norm_out": ("fp", "int8"),
    "in_proj_out": ("fp", "int8"),
    "conv_in": ("static", "dynamic"),
    "conv_out": ("int8", "fp32"),
    "ssm_u": ("int8", "grid", "requant", "fp32"),
    "ssm_impl": ("kernel", "reference"),
    "had_out": ("int8", "fp"),
    "act_dtype": ("fp32", "fp16"),
    "prep": ("quamba", "exact"),
}



# Each knob's values as a str-Enum: code compares members (recipe.rotate == Rotate.YES), and a member
# is its string everywhere it is written (json, f-strings, the stats), so the files read as before.
class Weights(StrEnum):
    FP32 = "fp32"
    FP16 = "fp16"
    INT8 = "int8"


class Rotate(StrEnum):
    YES = "yes"
    NO = "no"


class Store(StrEnum):
    """How an op's output is stored: kept floating point, or int8 at its calibrated scale."""
    FP = "fp"
    INT8 = "int8"


class ConvIn(StrEnum):
    STATIC = "static"
    DYNAMIC = "dynamic"


class ConvOut(StrEnum):
    INT8 = "int8"
    FP32 = "fp32"


class SsmU(StrEnum):
    INT8 = "int8"
    GRID = "grid"
    REQUANT = "requant"
    FP32 = "fp32"


class SsmImpl(StrEnum):
    KERNEL = "kernel"
    REFERENCE = "reference"


class ActDtype(StrEnum):
    FP32 = "fp32"
    FP16 = "fp16"


class Prep(StrEnum):
    QUAMBA = "quamba"
    EXACT = "exact"


KNOB_TYPES: dict[str, type[StrEnum]] = {
    "weights": Weights, "rotate": Rotate, "norm_out": Store, "in_proj_out": Store, "conv_in": ConvIn,
    "conv_out": ConvOut, "ssm_u": SsmU, "ssm_impl": SsmImpl, "had_out": Store, "act_dtype": ActDtype, "prep": Prep,
}
assert all(set(KNOBS[k]) == {m.value for m in t} for k, t in KNOB_TYPES.items()) and set(KNOBS) == set(KNOB_TYPES)

# Number formats as knobs (docs/formats.md): "none" (the recipe's own arithmetic) or a format of harness.formats
# (spec.FORMAT_NAMES; emulation.build checks the two lists agree). Off by default: the built-in modes never set
# them and record them only when set, so their numbers and stats are unchanged.
NumberFormat = StrEnum("NumberFormat", {"NONE": "none", **{n.upper(): n for n in (
    "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp4_e2m1",
    "nvfp4", "nvfp4_noglobal", "hifp8", "int8", "int8_g128", "int4_g128")}})
# weight_format: in_proj, x_proj, dt_proj, out_proj weights; act_format: every activation quantization point
# (norm, in_proj, conv, x_proj, dt_proj outputs, and the out_proj input); state_format: the SSM state, every step
FORMAT_KNOBS: tuple[str, ...] = ("weight_format", "act_format", "state_format")
_LAYER_RANGE_RE = re.compile(r"^(\d+)(-(\d*))?$")


def parse_layer_range(text: str) -> tuple[int, int | None]:
    """"3" -> (3, 3), "0-3" -> (0, 3), "4-" -> (4, None) (to the last block); ModeError otherwise."""
    m = _LAYER_RANGE_RE.match(text.strip()) if isinstance(text, str) else None
    if m is None or (m.group(3) and int(m.group(3)) < int(m.group(1))):
        raise ModeError(f"layer range {text!r} is not valid; use a block index (3), a range (0-3) or an open "
                        f"range (4-)")
    lo = int(m.group(1))
    return lo, (lo if m.group(2) is None else int(m.group(3)) if m.group(3) else None)

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

    def __post_init__(self) -> None:
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
        for problem in _inconsistencies(self):
            raise ModeError(f"mode {self.name!r}: {problem}")

    def knobs(self) -> dict[str, StrEnum]:
        """Every knob; the format knobs and the per-layer table only where set (the stats' "recipe")."""
        knobs = {k: getattr(self, k) for k in KNOBS}
        knobs.update({k: getattr(self, k) for k in FORMAT_KNOBS if getattr(self, k) != NumberFormat.NONE})
        if self.layers:
            knobs["layers"] = {r: dict(kv) for r, kv in self.layers}
        return knobs

    def for_layer(self, i: int) -> "ModeRecipe":
        """The recipe block i runs: the format knobs of every `layers` range holding i applied in order."""
        values = {}
        for text, kv in self.layers:
            lo, hi = parse_layer_range(text)
            if lo <= i and (hi is None or i <= hi):
                values.update(kv)
        return replace(self, layers=(), **values) if values else replace(self, layers=())

    @property
    def has_formats(self) -> bool:
        return bool(self.layers) or any(getattr(self, k) != NumberFormat.NONE for k in FORMAT_KNOBS)

    def as_dict(self) -> dict[str, str]:
        return asdict(self)

    @property
    def needs_calibration(self) -> bool:
        """True when any activation is quantized, i.e. the recipe reads calibrated scales."""
        return (self.weights == Weights.INT8 or self.norm_out == Store.INT8 or self.in_proj_out == Store.INT8
                or self.conv_out == ConvOut.INT8 or self.ssm_u in (SsmU.INT8, SsmU.GRID, SsmU.REQUANT) or self.had_out == Store.INT8)


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
    if r.conv_in == ConvIn.DYNAMIC and r.weights != Weights.INT8:
        out.append("conv_in=dynamic needs weights=int8: only the int8 conv quantizes its input")
    return out


def _recipe(name: str, title: str, row: str) -> ModeRecipe:
    values = row.split()
    return ModeRecipe(name, title, **dict(zip(KNOBS, values, strict=True)))


# fmt: off
# docs/spec/modes.md "The built-in modes", column order = KNOBS order:
#   weights rotate norm_out in_proj_out conv_in conv_out ssm_u ssm_impl had_out act_dtype prep
_BUILTIN_ROWS = (
    ("fp32", "floating-point reference",                        "fp32 yes fp   fp   static  fp32 fp32    reference fp   fp32 exact"),
    ("1",    "original model, fp16 (no rotation)",              "fp16 no  fp   fp   static  fp32 fp32    reference fp   fp16 exact"),
    ("0",    "Quamba1 W8A8 baseline",                           "int8 yes int8 int8 static  int8 int8    kernel    int8 fp16 quamba"),
    ("2-0",  "dequant -> requant -> kernel scan",               "int8 yes int8 int8 static  int8 grid    kernel    int8 fp16 quamba"),
    ("2-1",  "int8 u, reference scan",                          "int8 yes int8 int8 static  int8 int8    reference int8 fp16 quamba"),
    ("2-2",  "dequantized u (int8 grid), reference scan",       "int8 yes int8 int8 static  int8 grid    reference int8 fp16 quamba"),
    ("2-3",  "true fp32 conv, re-quantized u, reference scan",  "int8 yes int8 int8 static  fp32 requant reference int8 fp16 quamba"),
    ("2-4",  "true fp32 conv, fp32 u, reference scan",          "int8 yes int8 int8 static  fp32 fp32    reference int8 fp16 quamba"),
    ("3",    "hybrid: dynamic conv input, fp32 conv and scan",  "int8 yes int8 fp   dynamic fp32 fp32    reference int8 fp16 quamba"),
)
# fmt: on

PRESETS: dict[str, tuple[str, ...]] = {
    "all": ("fp32", "0", "2-0", "2-1", "2-2", "2-3", "2-4", "3"),
    "essential": ("fp32", "0", "2-1", "2-2", "2-4"),
    "quant_only": ("0", "2-0", "2-1", "2-2", "2-3", "2-4", "3"),
}

# What a preset means on a Mamba-2 model (docs/modes.md "Mamba-2"): the built-in modes that run there.
# Only float recipes run on Mamba-2 blocks so far; Quamba2's recipes (q2-w8a8 ...) are issue 22's next part.
MAMBA2_PRESETS: dict[str, tuple[str, ...]] = {"all": ("fp32", "1"), "essential": ("fp32", "1"), "quant_only": ()}


def architecture_problem(recipe: "ModeRecipe", architecture: str) -> str | None:
    """Why `recipe` cannot run on a model of `architecture` ("mamba1", "mamba2"), or None when it can."""
    if architecture != "mamba2":
        return None
    if recipe.needs_calibration:
        return ("it quantizes (Quamba1's W8A8 recipe of Mamba-1 blocks); on Mamba-2 only float recipes run "
                "(weights fp32/fp16, every output fp, no int8 activations)")
    if recipe.prep == Prep.QUAMBA:
        return "prep=quamba prepares Mamba-1 weights as Quamba1 does; use prep=exact on Mamba-2"
    return None


BUILTIN_MODES: dict[str, ModeRecipe] = {name: _recipe(name, title, row) for name, title, row in _BUILTIN_ROWS}

# The models calibration runs through (not user modes), one per prep: the rotated
# model with fp16 weights and fp16 activations, as Quamba calibrates its fp16 model
# (spec notes §2.3). harness.emulation.build gives the prep=quamba one the arithmetic of that model
# (build_block's calibration flag): fp16 conv output before SiLU, mamba_ssm's scan.
CALIBRATION_RECIPES: dict[str, ModeRecipe] = {
    prep: _recipe("calibration", f"rotated fp16 model used for calibration (prep={prep})",
                  f"fp16 yes fp fp static fp32 fp32 {'kernel' if prep == 'quamba' else 'reference'} fp fp16 {prep}")
    for prep in KNOBS["prep"]
}


class ModeRegistry:
    """Name -> recipe, seeded with the built-in modes."""

    def __init__(self) -> None:
        self._modes: dict[str, ModeRecipe] = dict(BUILTIN_MODES)

    def register(self, recipe: ModeRecipe, replace_existing: bool = False) -> None:
        if recipe.name in self._modes and not replace_existing:
            raise ModeError(f"mode {recipe.name!r} is already defined; built-in modes: {', '.join(BUILTIN_MODES)}")
        self._modes[recipe.name] = recipe

    def get(self, name: str) -> ModeRecipe:
        if name not in self._modes:
            raise ModeError(f"unknown mode {name!r}; valid: {', '.join(self._modes)} "
                            f"(presets: {', '.join(PRESETS)})")
        return self._modes[name]

    def names(self) -> list[str]:
        return list(self._modes)

    def resolve(self, requested: list[str], architecture: str = "mamba1") -> list[ModeRecipe]:
        """Expand presets, keep order, drop duplicates, validate every name (and that it runs on `architecture`)."""
        names: list[str] = []
        presets = MAMBA2_PRESETS if architecture == "mamba2" else PRESETS
        for item in requested:
            if item in presets and not presets[item]:
                raise ModeError(f"preset {item!r} has no modes for a {architecture} model; valid there: "
                                + "; ".join(f"{k} = {' '.join(v)}" for k, v in presets.items() if v))
            for name in presets.get(item, (item,)):
                if name not in names:
                    names.append(name)
        if not names:
            raise ModeError(f"no modes given; valid: {', '.join(self._modes)} (presets: {', '.join(PRESETS)})")
        recipes = [self.get(n) for n in names]
        for r in recipes:
            if (why := architecture_problem(r, architecture)) is not None:
                runs = [n for n in self._modes if architecture_problem(self._modes[n], architecture) is None]
                raise ModeError(f"mode {r.name!r} does not run on a {architecture} model: {why}; "
                                f"valid there: {', '.join(runs)}")
        return recipes


def get_mode(name: str) -> ModeRecipe:
    """A built-in mode by name (user modes come in through ``resolve_modes``)."""
    return ModeRegistry().get(name)


def list_modes() -> list[str]:
    return list(BUILTIN_MODES)


def resolve_modes(requested: list[str], modes_file: Path | None = None, architecture: str = "mamba1") -> list[ModeRecipe]:
    """Mode names/presets -> recipes, with the user modes of ``modes_file`` (JSON or TOML) added;
    a mode that does not run on `architecture` (the model's, spec.ModelDims.architecture) is a ModeError."""
    registry = ModeRegistry()
    if modes_file is not None:
        for recipe in load_modes_file(modes_file):
            registry.register(recipe)
    return registry.resolve(requested, architecture)


def load_modes_file(path: Path) -> list[ModeRecipe]:
    """Read user-defined modes.

    JSON: {"modes": {"NAME": {"base": "2-4", "title": "...", "conv_in": "dynamic"}}}
    TOML: [modes.NAME] base = "2-4"  title = "..."  conv_in = "dynamic"
    ``base`` (optional) names a built-in mode whose knobs are the defaults; without
    it every knob must be given, except ``prep`` (default: quamba for int8 weights, else exact).
    """
    path = Path(path)
    try:
        if not path.is_file() and path.exists():
            raise ModeError(f"modes file {path} is not a regular file; give a JSON or TOML file")
        if path.exists() and path.stat().st_size > 1 << 20:
            raise ModeError(f"modes file {path} is larger than 1 MiB; give a JSON or TOML file of mode recipes")
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ModeError(f"cannot read modes file {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ModeError(f"modes file {path} is not UTF-8 ({e.reason}); give a JSON or TOML file") from None
    try:
        data = tomllib.loads(text) if path.suffix.lower() == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ModeError(f"modes file {path} is not valid {'TOML' if path.suffix.lower() == '.toml' else 'JSON'}: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("modes"), dict) or set(data) - {"modes"}:
        raise ModeError(f"modes file {path} must hold one table 'modes' mapping mode names to knob tables, "
                        'e.g. {"modes": {"my-mode": {"base": "2-4", "conv_in": "dynamic"}}}')
    return [_user_recipe(path, name, spec) for name, spec in data["modes"].items()]


def _user_recipe(path: Path, name: str, spec: object) -> ModeRecipe:
    if not isinstance(spec, dict):
        raise ModeError(f"modes file {path}: mode {name!r} must be a table of knobs")
    valid_keys = ("base", "title", *KNOBS, *FORMAT_KNOBS, "layers")
    unknown = [k for k in spec if k not in valid_keys]
    if unknown:
        raise ModeError(f"modes file {path}: mode {name!r} has unknown key(s) {', '.join(map(repr, unknown))}; "
                        f"valid keys: {', '.join(valid_keys)}")
    values = {k: v for k, v in spec.items() if k in KNOBS or k in FORMAT_KNOBS}
    bad = [k for k, v in values.items() if not isinstance(v, str)]
    if bad:
        raise ModeError(f"modes file {path}: mode {name!r}: knob values must be strings ({', '.join(bad)})")
    title = spec.get("title", f"user mode from {path.name}")
    if not isinstance(title, str):
        raise ModeError(f"modes file {path}: mode {name!r}: title must be a string, got {type(title).__name__}")
    if "base" in spec:
        base_name = spec["base"]
        if not isinstance(base_name, str) or base_name not in BUILTIN_MODES:
            raise ModeError(f"modes file {path}: mode {name!r}: unknown base {base_name!r}; "
                            f"valid: {', '.join(BUILTIN_MODES)}")
        return replace(BUILTIN_MODES[base_name], name=name, title=title, **values, **_layers_of(spec))
    if "prep" not in values:  # as the built-in modes: Quamba's preparation for int8 weights, exact otherwise
        values["prep"] = "quamba" if values.get("weights") == "int8" else "exact"
    missing = [k for k in KNOBS if k not in values]
    if missing:
        raise ModeError(f"modes file {path}: mode {name!r} lacks knob(s) {', '.join(missing)}; "
                        f"give them or name a built-in 'base' mode")
    return ModeRecipe(name=name, title=title, **values, **_layers_of(spec))


def _layers_of(spec: dict) -> dict:
    return {"layers": spec["layers"]} if "layers" in spec else {}

