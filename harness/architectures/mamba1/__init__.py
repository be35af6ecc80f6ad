"""Mamba-1 (mamba_ssm's Mamba, transformers' MambaMixer): the block's knob interpreter (build), its weight
preparation as Quamba does it (weights), its capture sites (emulation.capture.POINTS). Importing the package
registers it (harness.architectures.registry)."""
from __future__ import annotations

from ...emulation.capture import POINTS
from ...modes.knobs import PRESETS
from ...spec import FLOAT_DTYPES
from ..registry import Architecture, register_architecture
from .build import build_blocks
from .weights import PREPS, float_layer, int8_layer, quamba_fp16_layer

__all__ = ["MAMBA1"]


def prepare_layer(raw, weights: str, rotate: bool, prep: str, fp16):
    """Blocks' weights: int8 quantized from the fp16 variant, Quamba's fp16 preparation, or exact."""
    if prep not in PREPS:
        raise ValueError(f"unknown prep {prep!r}; valid: {', '.join(PREPS)}")
    if weights == "int8":
        return int8_layer(fp16())
    if prep == "quamba":
        if weights != "fp16":
            raise ValueError("prep=quamba prepares fp16 weights (Quamba's model is fp16); "
                             f"weights={weights} needs prep=exact")
        return quamba_fp16_layer(raw(), rotate)
    return float_layer(raw(), rotate, FLOAT_DTYPES[weights])


MAMBA1 = register_architecture(Architecture(
    "mamba1", "Mamba-1 (selective scan)", POINTS, build_blocks, prepare_layer, presets=PRESETS,
    extra={"formats": True}, model_types=("mamba",),
    class_names=("MambaForCausalLM", "MambaModel", "MambaLMHeadModel")))
