"""Recipe families, one folder each (float/, quamba/), registered by name in registry.py with their modes:
calibration, blocks, checkpoint formats and exports. Plugins add theirs the same way (docs/plugins.md)."""
