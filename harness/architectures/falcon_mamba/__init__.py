"""Falcon-Mamba (transformers' FalconMambaForCausalLM): Mamba-1 blocks whose dt, B and C pass weightless RMSNorms
(emulation.norms) before dt_proj and the scan. The block is Mamba-1's (architectures.mamba1: its knob interpreter
adds the norms when the dims carry ``mixer_rms_eps``), asked through the registry since architecture folders do
not import each other; the checkpoint reader is this folder's (config). Every Mamba-1 recipe runs on it; how each
quantizes the norms' outputs is mamba1.build.mixer_norms (docs/models.md, "Falcon-Mamba").
"""
from __future__ import annotations

from ...emulation.capture import NORMED_MAMBA1_POINTS
from ...modes.knobs import PRESETS
from ..registry import Architecture, get_architecture, register_architecture
from .config import FALCON_CLASSES, FALCON_MODEL_TYPES, open_falcon_mamba

__all__ = ["FALCON_MAMBA"]

_BLOCK = "mamba1"  # the architecture whose block and weight preparation this one's are
# Mamba-1's presets of the modes that run here: Quamba1's and the float ones; the Quamba-SE study and the field's
# recipes are defined on Mamba-1 (and Mamba-2) only, so those presets name no mode here (the exit-2 message says so)
_OWN = ("all", "essential", "quant_only")
FALCON_PRESETS: dict[str, tuple[str, ...]] = {name: (modes if name in _OWN else ()) for name, modes in PRESETS.items()}


def build_blocks(recipe, bank, scales, depth: int, calibration: bool = False) -> list:
    """Mamba-1's knob interpreter (the dims, a FalconMambaDims, add the norms)."""
    return get_architecture(_BLOCK).build_blocks(recipe, bank, scales, depth, calibration)


def prepare_layer(raw, weights: str, rotate: bool, prep: str, fp16):
    """Mamba-1's weight preparation: the norms have no weights, the rest is Mamba-1's."""
    return get_architecture(_BLOCK).prepare_layer(raw, weights, rotate, prep, fp16)


FALCON_MAMBA = register_architecture(Architecture(
    "falcon_mamba", "Falcon-Mamba (Mamba-1 with dt/B/C RMSNorms)", NORMED_MAMBA1_POINTS, build_blocks, prepare_layer,
    presets=FALCON_PRESETS, extra={"formats": True, "block": _BLOCK}, open_config=open_falcon_mamba,
    model_types=FALCON_MODEL_TYPES, class_names=FALCON_CLASSES))
