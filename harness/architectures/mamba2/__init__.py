"""Mamba-2 (mamba_ssm's Mamba2, transformers' Mamba2Mixer): its config and tensors (config), the block (block), the
float knob interpreter (build), the weight preparation (weights), its capture sites (emulation.capture.MAMBA2_POINTS).
Importing the package registers it (harness.architectures.registry)."""
from __future__ import annotations

from ...emulation.capture import MAMBA2_POINTS
from ...modes.knobs import MAMBA2_PRESETS
from ...spec import FLOAT_DTYPES
from ..registry import Architecture, register_architecture
from .build import FORMAT_KNOBS, build_blocks, build_mamba2_block, mamba2_layer_formats
from .config import open_mamba2
from .weights import float_layer_mamba2

__all__ = ["MAMBA2"]


def prepare_layer(raw, weights: str, rotate: bool, prep: str, fp16):
    """A float recipe's weights (the Mamba-2 recipes that quantize prepare their own from raw)."""
    return float_layer_mamba2(raw(), rotate, FLOAT_DTYPES[weights])


MAMBA2 = register_architecture(Architecture(
    "mamba2", "Mamba-2 (SSD)", MAMBA2_POINTS, build_blocks, prepare_layer, presets=MAMBA2_PRESETS,
    extra={"block": build_mamba2_block, "formats": FORMAT_KNOBS, "layer_formats": mamba2_layer_formats},
    open_config=open_mamba2, model_types=("mamba2",),
    class_names=("Mamba2ForCausalLM", "Mamba2Model")))
