"""The built-in modes, what runs on which architecture, and the registry that mode files extend."""
from __future__ import annotations

from .knobs import KNOBS, MAMBA2_PRESETS, PRESETS, ModeError, Prep
from .recipe import ModeRecipe

__all__ = ["architecture_problem", "BUILTIN_MODES", "CALIBRATION_RECIPES", "Q2_CALIBRATION_RECIPE", "ModeRegistry", "get_mode", "list_modes"]


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
    ("q2-w8a8", "Quamba2 W8A8 (Mamba-2)",                       "int8 yes int8 int8 static  int8 int8    kernel    int8 fp16 quamba2"),
    ("q2-w4a8", "Quamba2 W4A8: GPTQ int4, Marlin-QQQ",          "int4 yes int8 int8 static  int8 int8    kernel    int8 fp16 quamba2"),
    ("q2-w4a16", "Quamba2 W4A16: GPTQ int4, Marlin",            "int4 yes fp   fp   static  fp32 fp32    kernel    fp   fp16 quamba2"),
)
# fmt: on



def architecture_problem(recipe: "ModeRecipe", architecture: str) -> str | None:
    """Why `recipe` cannot run on a model of `architecture` ("mamba1", "mamba2"), or None when it can."""
    if architecture in recipe.architectures:
        return None
    if recipe.prep == Prep.QUAMBA2:
        return ("it is Quamba2's W8A8 of Mamba-2 blocks; Quamba2's W8A8 of a Mamba-1 model is Quamba1's "
                "(its head-grouped calibration raises NotImplementedError for Mamba-1, quamba/modelutils_mamba.py:"
                "240-241): run mode 0 there (q2-w4a8 and q2-w4a16 run on both)")
    if recipe.needs_calibration:
        return ("it quantizes (Quamba1's W8A8 recipe of Mamba-1 blocks); on Mamba-2 the float recipes run "
                "(weights fp32/fp16, every output fp, no int8 activations) and Quamba2's (q2-w8a8, q2-w4a8, q2-w4a16)")
    if recipe.prep == Prep.QUAMBA:
        return "prep=quamba prepares Mamba-1 weights as Quamba1 does; use prep=exact on Mamba-2"
    if recipe.has_formats:
        return ("its number formats (weight_format, act_format, state_format, layers) are applied to Mamba-1 "
                "blocks only so far; on Mamba-2 run it without them")
    return None


BUILTIN_MODES: dict[str, ModeRecipe] = {name: _recipe(name, title, row) for name, title, row in _BUILTIN_ROWS}

# The models calibration runs through (not user modes), one per prep: the rotated
# model with fp16 weights and fp16 activations, as Quamba calibrates its fp16 model
# (spec notes §2.3). harness.emulation.build gives the prep=quamba one the arithmetic of that model
# (build_block's calibration flag): fp16 conv output before SiLU, mamba_ssm's scan.
CALIBRATION_RECIPES: dict[str, ModeRecipe] = {
    prep: _recipe("calibration", f"rotated fp16 model used for calibration (prep={prep})",
                  f"fp16 yes fp fp static fp32 fp32 {'kernel' if prep == 'quamba' else 'reference'} fp fp16 {prep}")
    for prep in (Prep.QUAMBA, Prep.EXACT)
}
# Quamba2's calibration model (emulation.q2_calibration): the rotated fp16 Mamba-2, chunked SSD.
Q2_CALIBRATION_RECIPE = _recipe("calibration", "rotated fp16 Mamba-2 used for Quamba2's calibration",
                                "fp16 yes fp fp static fp32 fp32 kernel fp fp16 exact")


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

    def resolve(self, requested: list[str], architecture: str | None = "mamba1") -> list[ModeRecipe]:
        """Expand presets, keep order, drop duplicates, validate every name (and that it runs on `architecture`;
        None: the model is not known yet, the names only are checked, presets as on Mamba-1)."""
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
        recipes = [self.get(n).on_architecture(architecture) for n in names]
        for r in recipes if architecture is not None else ():
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
