"""Per-layer diagnostics a mode stores under ``modes.M.layers.Li.<key>`` (Quamba2's x groups, Quamba-SE's segments),
read back for `compare` and the report."""
from __future__ import annotations

__all__ = ["layer_entries_of"]


def _layer_number(name: str) -> int | None:
    return int(name[1:]) if name[:1] == "L" and name[1:].isdigit() else None


def layer_entries_of(stats: dict, key: str, modes: set[str] | None, layers: set[int] | None) -> dict:
    """mode -> "L{i}" -> the stored `key` entry, for the modes that have one (all modes when `modes` is None) and
    the layers asked for (all when None), in the file's order."""
    entries = stats.get("modes") if isinstance(stats.get("modes"), dict) else {}
    out: dict = {}
    for mode, entry in entries.items():
        per_layer = entry.get("layers") if isinstance(entry, dict) else None
        if not isinstance(per_layer, dict) or (modes is not None and mode not in modes):
            continue
        rows = {name: layer[key] for name, layer in per_layer.items()
                if isinstance(layer, dict) and key in layer and (layers is None or _layer_number(name) in layers)}
        if rows:
            out[mode] = rows
    return out
