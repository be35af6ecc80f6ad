"""Which modes a figure draws as one line, and how many lines it draws at most.

Modes whose drawn values are equal would coincide on a chart with nothing saying so: they are drawn
once, named together ("2-0 = 2-1"). A figure draws at most MAX_SERIES such groups (the worst ones,
by a badness the caller gives) and says how many modes it left out, so a file of 2000 modes gives
readable figures at the cost of 12 lines. Grouping is a hash map of the drawn values: linear in the modes.
"""
from __future__ import annotations

import hashlib
import math
from typing import Hashable, Mapping, Sequence

import numpy as np

__all__ = ["MAX_SERIES", "MAX_NAMES", "group_label", "equal_groups", "keep_worst", "array_key", "series_key"]

MAX_SERIES = 12
MAX_NAMES = 4


def group_label(modes: Sequence[str]) -> str:
    """'2-0 = 2-1'; beyond MAX_NAMES modes, the first ones and how many more."""
    shown = " = ".join(modes[:MAX_NAMES])
    return shown + (f" (+{len(modes) - MAX_NAMES} more)" if len(modes) > MAX_NAMES else "")


def equal_groups(keys: Mapping[str, Hashable]) -> dict[str, list[str]]:
    """First mode of each group -> every mode with the same key, in the modes' order."""
    by_key: dict[Hashable, list[str]] = {}
    for mode, key in keys.items():
        by_key.setdefault(key, []).append(mode)
    return {modes[0]: modes for modes in by_key.values()}


def keep_worst(groups: Mapping[str, list[str]], badness: Mapping[str, float],
               limit: int = MAX_SERIES) -> tuple[dict[str, list[str]], int]:
    """The `limit` groups of highest badness (NaN counts as worst; ties keep the run's order), in the run's
    order; and the number of modes left out."""
    def bad(head: str) -> float:
        b = badness.get(head, 0.0)
        return math.inf if b is None or math.isnan(b) else b
    heads = list(groups)
    order = sorted(range(len(heads)), key=lambda i: (-bad(heads[i]), i))
    kept = {heads[i] for i in order[:limit]}
    left_out = sum(len(groups[h]) for h in heads if h not in kept)
    return {h: list(groups[h]) for h in heads if h in kept}, left_out


def array_key(arr: np.ndarray) -> bytes:
    """Equal for arrays of the same dtype, shape and bytes (they draw the same lines)."""
    a = np.ascontiguousarray(arr)
    h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
    h.update(a.view(np.uint8).reshape(-1))
    return h.digest()


def series_key(values: Sequence[float | None] | None) -> tuple:
    """A hashable form of a drawn series: None and NaN alike (neither is drawn)."""
    if values is None:
        return ()
    return tuple(None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v) for v in values)


def identical_of(comparison: Mapping | None, modes: Sequence[str]) -> dict[str, list[str]]:
    """Each mode -> its group of bit-identical modes (the comparison's "identical_groups"; itself alone if none)."""
    out = {m: [m] for m in modes}
    for group in (comparison or {}).get("identical_groups") or []:
        present = [m for m in group if m in out]
        for m in present:
            out[m] = present
    return out
