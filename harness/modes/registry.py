"""The built-in modes as knob rows (docs/spec/modes.md), and the calibration models; the registry that owns
them by recipe family, and that plugins and mode files extend, is harness.recipes.registry."""
from __future__ import annotations

from .knobs import KNOBS, Prep
from .recipe import ModeRecipe

__all__ = ["BUILTIN_MODES", "CALIBRATION_RECIPES", "Q2_CALIBRATION_RECIPE"]


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
# Quamba2's calibration model (recipes.quamba.q2.calibration): the rotated fp16 Mamba-2, chunked SSD.
Q2_CALIBRATION_RECIPE = _recipe("calibration", "rotated fp16 Mamba-2 used for Quamba2's calibration",
                                "fp16 yes fp fp static fp32 fp32 kernel fp fp16 exact")
