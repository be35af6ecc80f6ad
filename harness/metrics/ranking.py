"""The sensitivity ranking: one order of a mode's layers, shared by the printed tables, --json and the report.

Rows are dicts with at least "layer" and any of "kl" (KL of the model with only that layer in the mode,
--sensitivity), "isolated_sqnr_db" and "accumulated_sqnr_db". The order is by the first measure any row
has, in this preference (docs/analysis.md):

    kl                   the harm itself, measured end to end: highest first
    isolated_sqnr_db     the layer's own error, not its effect on the output: lowest first
    accumulated_sqnr_db  errors of earlier layers included: lowest first

A NaN counts as the worst value (it must be looked at); layers without the measure come last.
"""
from __future__ import annotations

import math

__all__ = ["RANK_KEYS", "ORDER_TEXT", "rank_layers"]

RANK_KEYS = ("kl", "isolated_sqnr_db", "accumulated_sqnr_db")
ORDER_TEXT = {
    "kl": "ranked by the KL of the model with only this layer in the mode, most harmful first",
    "isolated_sqnr_db": "ranked by isolated SQNR, lowest first (the layer's own error; the KL of each layer "
                        "alone was not measured: --sensitivity measures it)",
    "accumulated_sqnr_db": "ranked by accumulated SQNR, lowest first (errors of earlier layers included; "
                           "neither the KL of each layer alone nor isolated outputs are available)",
}


def _number(value) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def rank_layers(rows: list[dict]) -> tuple[str | None, list[dict]]:
    """(the key ranked by, or None when no row has any measure; the rows in that order, most harmful first)."""
    key = next((k for k in RANK_KEYS if any(_number(r.get(k)) is not None for r in rows)), None)
    if key is None:
        return None, sorted(rows, key=lambda r: r["layer"])
    worse_is_higher = key == "kl"

    def order(r: dict) -> tuple:
        v = _number(r.get(key))
        if v is None:
            return (1, 0.0, r["layer"])
        if math.isnan(v):
            return (0, -math.inf, r["layer"])
        return (0, -v if worse_is_higher else v, r["layer"])
    return key, sorted(rows, key=order)
