"""The research fork 798253405/Quamba-SE's study (modes 4, 5-0…5-7, 6-0…6-4; docs/se-modes.md) as one recipe
family, ``quamba-se``. Importing the package registers it and its modes (harness.recipes.registry)."""
from __future__ import annotations

from ..registry import register_recipe
from .family import QuambaSE

__all__ = ["QuambaSE"]

register_recipe(QuambaSE())
