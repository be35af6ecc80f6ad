"""Hybrid SSM-attention models: the Bamba layout (transformers' BambaForCausalLM: IBM Bamba, Granite 4.0-H) and
Nemotron-H (NemotronHForCausalLM, nemotron.py), on the same blocks:
Mamba-2 blocks (Mamba-2's own, asked through the registry), attention and MLP blocks (block), the checkpoint
reader (config), the weight preparation (weights) and the float knob interpreter (build). Importing the package
registers it (harness.architectures.registry)."""
from __future__ import annotations

from ...emulation.capture import HYBRID_POINTS
from ...spec import FLOAT_DTYPES
from ..registry import Architecture, get_architecture, register_architecture
from .build import SSM_BLOCKS, build_blocks, hybrid_layer_formats
from .config import BAMBA_CLASSES, BAMBA_MODEL_TYPES, open_bamba
from .nemotron import NEMOTRON_CLASSES, NEMOTRON_MODEL_TYPES, open_nemotron_h
from .weights import attention_layer, mlp_layer

__all__ = ["BAMBA", "NEMOTRON_H"]


def prepare_layer(raw, weights: str, rotate: bool, prep: str, fp16):
    """A float recipe's weights of one block, by the block's kind (the tensors its raw table holds)."""
    tensors = raw()
    if "in_proj" in tensors:
        return get_architecture(SSM_BLOCKS).prepare_layer(lambda: tensors, weights, rotate, prep, fp16)
    if weights not in FLOAT_DTYPES:
        raise ValueError(f"weights={weights}: the attention and MLP blocks of a hybrid take fp32 or fp16 weights")
    layer = attention_layer if "q_proj" in tensors else mlp_layer
    return layer(tensors, rotate, FLOAT_DTYPES[weights])


# weight_format and act_format on every linear (build.py); state_format is Mamba-1's only
_FORMATS = {"formats": ("weight_format", "act_format"), "layer_formats": hybrid_layer_formats}
BAMBA = register_architecture(Architecture(
    "bamba", "Bamba / Granite 4.0-H (Mamba-2, attention and MLP blocks)", HYBRID_POINTS, build_blocks, prepare_layer,
    presets={"all": ("fp32", "1", "q2-w8a8", "q2-w8a8-a8-kv8"), "essential": ("fp32", "1", "q2-w8a8"),
             "quant_only": ("q2-w8a8", "q2-w8a8-a8", "q2-w8a8-a8-kv8", "q2-w8a8-a8-kvfp8")},
    open_config=open_bamba, model_types=BAMBA_MODEL_TYPES, class_names=BAMBA_CLASSES, extra=_FORMATS))
# Nemotron-H: the same blocks (attention without RoPE, a ReLU^2 MLP), one block per layer (nemotron.py)
NEMOTRON_H = register_architecture(Architecture(
    "nemotron_h", "Nemotron-H (Mamba-2, attention and MLP layers)", HYBRID_POINTS, build_blocks, prepare_layer,
    presets=BAMBA.presets, open_config=open_nemotron_h, model_types=NEMOTRON_MODEL_TYPES,
    class_names=NEMOTRON_CLASSES, extra=_FORMATS))
