"""The recipes of enyac-group/Quamba: Quamba1's W8A8, Quamba2's W8A8, W4A8 and W4A16 (families.py), their
calibrations, blocks, checkpoints and exports. Importing the package registers the families, the checkpoint
formats and the exporters (harness.recipes.registry)."""
from __future__ import annotations

from ..registry import register_recipe
from .export import register_exporters
from .families import Quamba1, Quamba2, Quamba2HybridW8A8, Quamba2W4
from .formats import register_formats
from .w4ax import Quamba2W4AX

for _family in (Quamba1(), Quamba2(), Quamba2W4(), Quamba2HybridW8A8(), Quamba2W4AX()):
    register_recipe(_family)
register_formats()
register_exporters()
