"""Floating point: fp32, fp16 (mode 1) and the number formats (weight_format, act_format, state_format and their
per-layer tables, docs/formats.md), run by each architecture's own knob interpreter. Importing the package
registers the family (harness.recipes.registry)."""
from __future__ import annotations

from ...modes import ModeRecipe, Prep, Weights
from ...architectures.registry import architecture_names, get_architecture
from ..registry import Recipe, register_recipe

__all__ = ["Float"]


class Float(Recipe):
    """Every mode with float weights and no quantized activation, prepared exactly (prep=exact)."""

    name = "float"
    title = "floating point: fp32, fp16 and the number formats"

    def owns(self, mode: ModeRecipe) -> bool:
        return not mode.needs_calibration and mode.prep == Prep.EXACT and mode.weights != Weights.INT4

    def architectures(self, mode: ModeRecipe) -> tuple[str, ...]:
        """Every architecture; a mode with number formats only those whose blocks apply them (``formats`` in
        the architecture's ``extra``)."""
        names = architecture_names()
        return tuple(n for n in names if get_architecture(n).extra.get("formats")) if mode.has_formats else tuple(names)

    def architecture_problem(self, mode: ModeRecipe, architecture: str) -> str | None:
        if architecture in self.architectures(mode):
            return None
        return ("its number formats (weight_format, act_format, state_format, layers) are applied to Mamba-1 "
                "blocks only so far; on Mamba-2 run it without them")


register_recipe(Float())
