"""The knobs of a recipe (docs/spec/modes.md "The knobs"): their values as StrEnums, the number formats
that may stand in for them, and layer ranges of a per-layer assignment."""
from __future__ import annotations

import re
from enum import StrEnum

__all__ = ["ModeError", "KNOBS", "Weights", "Rotate", "Store", "ConvIn", "ConvOut", "SsmU", "SsmImpl", "ActDtype",
           "Prep", "KNOB_TYPES", "NumberFormat", "FORMAT_KNOBS", "parse_layer_range", "PRESETS", "MAMBA2_PRESETS",
           "XGroups", "StateDtype", "Q2_KNOBS", "Q2_KNOB_TYPES", "Embedding", "LmHead", "Q2_HEAD_KNOBS",
           "Q2_HEAD_KNOB_TYPES"]


class ModeError(ValueError):
    """A mode name, knob or mode file is invalid; the message lists what is valid."""


# knob -> allowed values (docs/spec/modes.md "The knobs")
KNOBS: dict[str, tuple[str, ...]] = {
    "weights": ("fp32", "fp16", "int8", "int4"),
    "rotate": ("yes", "no"),
    "norm_out": ("fp", "int8"),
    "in_proj_out": ("fp", "int8"),
    "conv_in": ("static", "dynamic"),
    "conv_out": ("int8", "fp32"),
    "ssm_u": ("int8", "grid", "requant", "fp32"),
    "ssm_impl": ("kernel", "reference"),
    "had_out": ("int8", "fp"),
    "act_dtype": ("fp32", "fp16"),
    "prep": ("quamba", "exact", "quamba2"),
}



# Each knob's values as a str-Enum: code compares members (recipe.rotate == Rotate.YES), and a member
# is its string everywhere it is written (json, f-strings, the stats), so the files read as before.
class Weights(StrEnum):
    FP32 = "fp32"
    FP16 = "fp16"
    INT8 = "int8"
    INT4 = "int4"  # Quamba2's GPTQ int4 weights (q2-w4a8, q2-w4a16; prep=quamba2 only)


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
    QUAMBA2 = "quamba2"  # Quamba2's W8A8 of Mamba-2 blocks (docs/modes.md "Mamba-2")


KNOB_TYPES: dict[str, type[StrEnum]] = {
    "weights": Weights, "rotate": Rotate, "norm_out": Store, "in_proj_out": Store, "conv_in": ConvIn,
    "conv_out": ConvOut, "ssm_u": SsmU, "ssm_impl": SsmImpl, "had_out": Store, "act_dtype": ActDtype, "prep": Prep,
}
assert all(set(KNOBS[k]) == {m.value for m in t} for k, t in KNOB_TYPES.items()) and set(KNOBS) == set(KNOB_TYPES)

# Quamba2's variant knobs (docs/modes.md "Variant knobs of q2-w8a8"): prep=quamba2 only; the first value is the
# default, which the built-in rows leave as it is and the stats record only when changed (beside KNOB_TYPES, so the
# built-in rows and their stats stay as they were).
class XGroups(StrEnum):
    """The conv's x output scales: per (SSD group, head group, dim group), or one per tensor (percentile)."""
    GROUPED = "grouped"
    TENSOR = "tensor"


class StateDtype(StrEnum):
    """The SSM state handed from the prefill to the decode step and kept between steps: Quamba2's int8 at the
    grouped ssm_state_scale, or fp32 (never quantized)."""
    INT8 = "int8"
    FP32 = "fp32"


Q2_KNOB_TYPES: dict[str, type[StrEnum]] = {"x_groups": XGroups, "state_dtype": StateDtype}
Q2_KNOBS: dict[str, tuple[str, ...]] = {k: tuple(m.value for m in t) for k, t in Q2_KNOB_TYPES.items()}


# Quamba2's quantized embedding and lm_head (quantize_fp16_model's --quantize_embedding/--quantize_lm_head,
# enyac-group/Quamba c474646 quamba/modelutils_mamba.py:615-660; docs/modes.md "Embedding and lm_head"): every
# prep=quamba2 recipe; the first value is the default (recorded only when changed, as Q2_KNOBS).
class Embedding(StrEnum):
    """The embedding table: fp16 rows, or W8O16Embedding's int8 / W4O16Embedding's int4 codes, fp16 per-row scale."""
    FP16 = "fp16"
    INT8 = "int8"
    INT4 = "int4"


class LmHead(StrEnum):
    """lm_head: the fp16 Linear, or the recipe's own quantized form (W8A8B16O16Linear for q2-w8a8, W4A8B16O16Linear
    for q2-w4a8 and q2-w4ax, W4A16B16O16Linear for q2-w4a16)."""
    FP16 = "fp16"
    QUANTIZED = "quantized"


Q2_HEAD_KNOB_TYPES: dict[str, type[StrEnum]] = {"embedding": Embedding, "lm_head": LmHead}
Q2_HEAD_KNOBS: dict[str, tuple[str, ...]] = {k: tuple(m.value for m in t) for k, t in Q2_HEAD_KNOB_TYPES.items()}

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


# presets: names for lists of built-in modes
PRESETS: dict[str, tuple[str, ...]] = {
    "all": ("fp32", "0", "2-0", "2-1", "2-2", "2-3", "2-4", "3"),
    "essential": ("fp32", "0", "2-1", "2-2", "2-4"),
    "quant_only": ("0", "2-0", "2-1", "2-2", "2-3", "2-4", "3"),
    # the Quamba-SE fork's study (harness.recipes.se, docs/se-modes.md): its dual-path modes 5 and 6 as side by
    # side comparisons (mode 5's logits are 5-1's, mode 6's are fp32 u with RNE x_proj codes), and all of it
    "5": ("fp32", "5-0", "5-1", "5-2"),
    "6": ("fp32", "6-0", "6-1"),
    "se": ("fp32", "0", "4", "5-0", "5-1", "5-2", "5-3", "5-4", "5-6", "5-7", "6-0", "6-1", "6-2", "6-3", "6-4"),
    # the field's recipes beside Quamba's (issue 33, docs/field-recipes.md): fp32, Quamba1's mode 0, each recipe
    "field": ("fp32", "0", "naive-static", "naive-dynamic", "smq-ssm", "mambaquant-w8a8", "mambaquant-w8a8+quamba",
              "mambaquant-w4a8"),
}

# What a preset means on a Mamba-2 model (docs/modes.md "Mamba-2"): the built-in modes that run there.
# Float recipes and Quamba2's W8A8 (q2-w8a8), W4A8 (q2-w4a8) and W4A16 (q2-w4a16); `essential` leaves out the
# two W4 recipes (their GPTQ takes a few calibration forwards).
MAMBA2_PRESETS: dict[str, tuple[str, ...]] = {"all": ("fp32", "1", "q2-w8a8", "q2-w4a8", "q2-w4a16"),
                                              "essential": ("fp32", "1", "q2-w8a8"),
                                              "quant_only": ("q2-w8a8", "q2-w4a8", "q2-w4a16"),
                                              "5": (), "6": (), "se": (),  # Quamba-SE: Mamba-1 only
                                              # the recipes of the field defined on Mamba-2 (SmQ-SSM and
                                              # MambaQuant are Mamba-1 only)
                                              "field": ("fp32", "q2-w8a8", "naive-static", "naive-dynamic")}
