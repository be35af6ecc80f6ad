"""Quamba2's x group diagnostics as text: `compare`'s per-layer table of the q2 modes (metrics.q2groups,
stats ``modes.M.layers.Li.q2_groups``) and what --json gets of them."""
from __future__ import annotations

import math

from .layer_entries import layer_entries_of

__all__ = ["q2_groups_of", "q2_group_text"]


def q2_groups_of(stats: dict, modes: set[str] | None, layers: set[int] | None) -> dict:
    """mode -> "L{i}" -> the stored q2_groups entry, for the modes that have one (all modes when `modes` is None)
    and the layers asked for (all when None), in the file's order."""
    return layer_entries_of(stats, "q2_groups", modes, layers)


def _db(x) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return "inf" if x == math.inf else f"{x:.1f}"


def _pct(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.3g}%"


def _worst_cell(sqnr: list, sat: list) -> tuple[tuple[int, int, int], float, float] | None:
    cells = [((g, h, d), v, sat[g][h][d]) for g, per_g in enumerate(sqnr) for h, per_h in enumerate(per_g)
             for d, v in enumerate(per_h) if v is not None and not math.isnan(v)]
    return min(cells, key=lambda c: c[1]) if cells else None


def _by_group(rows: list, fmt) -> str:
    return "  ".join(f"g{g} [{' '.join(fmt(v) for v in row)}]" for g, row in enumerate(rows))


def _layer_lines(mode: str, layer: str, q: dict) -> list[str]:
    sqnr, sat, table = q["sqnr_db"], q["saturation"], q.get("scales", {})
    line = f"{mode}  {layer}: x {_db(sqnr['all'])} dB, saturated {_pct(sat['all'])}"
    worst = _worst_cell(sqnr["cells"], sat["cells"])
    if worst is not None:
        (g, h, d), value, frac = worst
        scale = table.get("x_table", [[[None]]])
        s = scale[g][h][d] if g < len(scale) and h < len(scale[g]) and d < len(scale[g][h]) else None
        line += f"; worst cell g{g}/hg{h}/dg{d} {_db(value)} dB" + (f" at scale {s:.4g}" if s is not None else "") \
            + f", saturated {_pct(frac)}"
    return [line, f"  dB by head group: {_by_group(sqnr['head_groups'], _db)}",
            f"  dB by dim group:  {_by_group(sqnr['dim_groups'], _db)}",
            f"  saturated by head group: {_by_group(sat['head_groups'], _pct)}"]


def q2_group_text(groups: dict) -> str:
    """The printed table (empty when no mode has the diagnostics)."""
    if not groups:
        return ""
    lines = ["", "Quamba2 x groups: SQNR of the int8 x against the float x its quantizer saw, "
             "saturated = codes at -128 or 127 (docs/analysis.md, Quamba2 x groups)"]
    for mode, layers in groups.items():
        for layer, q in layers.items():
            lines.extend(_layer_lines(mode, layer, q))
    return "\n".join(lines)
