"""Modes as data: the knobs of docs/spec/modes.md, the built-in recipes, presets and user mode files.

A ``ModeRecipe`` holds knob values only; ``harness.emulation.build`` is the single place
that turns a recipe into emulated modules. Built-in modes are entries of the
same registry that ``--modes_file`` extends.
"""
from __future__ import annotations

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
    "load_modes_file",
    "CALIBRATION_RECIPES",
    "NumberFormat",
    "FORMAT_KNOBS",
    "parse_layer_range",
    "MAMBA2_PRESETS",
    "Q2_CALIBRATION_RECIPE",
    "Q2_KNOBS",
    "XGroups",
    "StateDtype",
    "Q2_HEAD_KNOBS",
    "Embedding",
    "LmHead",
]

from .knobs import (FORMAT_KNOBS, KNOB_TYPES, KNOBS, MAMBA2_PRESETS, PRESETS, ActDtype, ConvIn, ConvOut, ModeError,
                    NumberFormat, Prep, Rotate, SsmImpl, SsmU, Store, Weights, parse_layer_range)
from .knobs import Q2_KNOBS, StateDtype, XGroups
from .knobs import Q2_HEAD_KNOBS, Embedding, LmHead
from .recipe import ModeRecipe
from .registry import BUILTIN_MODES, CALIBRATION_RECIPES, Q2_CALIBRATION_RECIPE
from .files import load_modes_file
