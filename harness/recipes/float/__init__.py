"""Floating point: fp32, fp16 (mode 1) and the number formats (weight_format, act_format, state_format and their
per-layer tables, docs/formats.md), run by each architecture's own knob interpreter. Importing the package
registers the family (harness.recipes.registry)."""
from __future__ import annotations

from ...modes import ModeRecipe, NumberFormat, Prep, Weights
from ...modes.knobs import FORMAT_KNOBS
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
        """Every architecture; a mode with number formats only those whose blocks apply the format knobs it sets
        (``formats`` in the architecture's ``extra``: True for all of them, else the knobs it applies)."""
        names = architecture_names()
        if not mode.has_formats:
            return tuple(names)
        used = _format_knobs(mode)
        return tuple(n for n in names if (f := get_architecture(n).extra.get("formats")) is True
                     or (f and used <= set(f)))

    def architecture_problem(self, mode: ModeRecipe, architecture: str) -> str | None:
        if architecture in self.architectures(mode):
            return None
        applied = get_architecture(architecture).extra.get("formats")
        if applied and applied is not True:
            return (f"{' and '.join(sorted(_format_knobs(mode) - set(applied)))} is applied to Mamba-1 blocks only "
                    f"(a {architecture} model's blocks take {', '.join(applied)}); run it without")
        return (f"its number formats (weight_format, act_format, state_format, layers) are not applied to {architecture} "
                "blocks; run it without them")


def _format_knobs(mode: ModeRecipe) -> set[str]:
    """The format knobs a mode sets, on its own or in any range of its ``layers`` table."""
    used = {k for k in FORMAT_KNOBS if getattr(mode, k) != NumberFormat.NONE}
    return used | {k for _r, kv in mode.layers for k, v in dict(kv).items() if k in FORMAT_KNOBS and v != "none"}


register_recipe(Float())
