"""A mode's backbone: the embedding and blocks 0..depth, built by the mode's recipe family (recipes.registry)."""
from __future__ import annotations

from ..emulation.build import WeightSource, act_dtype
from ..emulation.modules import EmuBackbone
from ..kernels.embedding_head import quantized_rows
from ..modes import Embedding, ModeRecipe, Rotate
from ..recipes.registry import recipe_for

__all__ = ["build_backbone"]


def build_backbone(recipe: ModeRecipe, bank: WeightSource, scales: list | None, depth: int,
                   calibration: bool = False) -> EmuBackbone:
    """Embedding and blocks 0..depth of `recipe`; nothing deeper is read or built. calibration: the blocks of a
    calibration model (the knob interpreter's calibration arithmetic, harness.architectures.mamba1.build)."""
    if recipe.needs_calibration and scales is None:
        raise ValueError(f"mode {recipe.name!r} quantizes activations and needs calibrated scales")
    family = recipe_for(recipe)
    blocks = family.build_blocks(recipe, bank, scales, depth, calibration)
    rotate, dtype = recipe.rotate == Rotate.YES, act_dtype(recipe)
    embed = family.embedding(recipe, bank, rotate, dtype)
    if embed is None and recipe.embedding != Embedding.FP16:  # Quamba2's W8O16/W4O16Embedding (kernels.embedding_head)
        return EmuBackbone(lambda ids: quantized_rows(bank.embed(ids, rotate, dtype, recipe.prep, recipe.weights),
                                                      str(recipe.embedding)), blocks)
    if embed is None:
        return EmuBackbone(lambda ids: bank.embed(ids, rotate, dtype, recipe.prep, recipe.weights), blocks)
    return EmuBackbone(embed, blocks)
