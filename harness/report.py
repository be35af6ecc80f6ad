"""Text output: per-mode summaries (the research tool's layout) and comparison tables (tabulate)."""
from __future__ import annotations

import math

from tabulate import tabulate

__all__ = ["mode_summary", "comparison_tables", "short_comparison", "fmt", "undefined_notes"]

_RULE = "=" * 98
_TABLE_COLUMNS = ("mse", "mae", "rmse", "max_abs", "rel_l2", "sqnr_db", "cosine", "pearson", "p50", "p90", "p99")
_HEADERS = ("mode", "MSE", "MAE", "RMSE", "max|err|", "at (b, t, c)", "rel L2", "SQNR dB", "cosine", "Pearson",
            "p50 |err|", "p90 |err|", "p99 |err|", "input differs")


def fmt(value) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value == math.inf else ("-inf" if value == -math.inf else "nan")
    return f"{value:.6g}"


def mode_summary(mode: str, entry: dict, tensors: list[str]) -> str:
    """The research tool's per-mode block: shape, first 10 values, mean, std, range per tensor."""
    lines = [_RULE, f"MODE {mode}  ({entry.get('title', '')})", _RULE]
    if entry.get("status") != "ok":
        lines.append(f"  FAILED: {entry.get('error')}")
        return "\n".join(lines)
    for name in tensors:
        s = entry["tensors"].get(name)
        if s is None:
            continue
        first = ", ".join(f"'{v:.6f}'" for v in s["first_10"])
        lines += [
            "",
            f"{name.upper()} (Shape: {s['shape']}){'  int8 at scale ' + fmt(s['scale']) if s.get('quantized') else ''}:",
            f"  First 10 values: [{first}]",
            f"  Mean: {s['mean']:.6f}",
            f"  Std:  {s['std']:.6f}",
            f"  Range: [{s['min']:.6f}, {s['max']:.6f}]",
        ]
        if s.get("nan_count") or s.get("inf_count"):
            lines.append(f"  NaN: {s['nan_count']}  Inf: {s['inf_count']}")
    return "\n".join(lines)


def _rows(comparison: dict, tensor: str, titles: dict[str, str]) -> list[list[str]]:
    rows = []
    for mode, by_tensor in comparison["modes"].items():
        row = by_tensor.get(tensor)
        if row is None:
            continue
        label = f"{mode} ({titles[mode]})" if mode in titles else mode
        cells = [fmt(row[c]) for c in _TABLE_COLUMNS]
        where = "(" + ", ".join(map(str, row["max_abs_index"])) + ")"
        rows.append([label, *cells[:4], where, *cells[4:], fmt(row.get("input_differs"))])
    return rows


def _tensor_order(comparison: dict) -> list[str]:
    names: list[str] = []
    for by_tensor in comparison["modes"].values():
        names += [t for t in by_tensor if t not in names]
    return names


def comparison_tables(comparison: dict, titles: dict[str, str] | None = None) -> str:
    """One table per tensor: every mode against the reference, MSE and MAE first."""
    titles = titles or {}
    ref = comparison["reference"]
    out = []
    for tensor in _tensor_order(comparison):
        out.append(f"\n{tensor} vs {ref} (d = mode - {ref})")
        out.append(tabulate(_rows(comparison, tensor, titles), headers=_HEADERS, disable_numparse=True))
    out.append(identical_text(comparison))
    for mode, skipped in comparison.get("skipped", {}).items():
        for tensor, reason in skipped.items():
            out.append(f"not compared: {mode} {tensor}: {reason}")
    out += undefined_notes(comparison)
    return "\n".join(out)


def undefined_notes(comparison: dict) -> list[str]:
    """One line per (mode, tensor) whose metrics are nan: which ones and why."""
    lines = []
    for mode, by_tensor in comparison["modes"].items():
        for tensor, row in by_tensor.items():
            by_reason: dict[str, list[str]] = {}
            for metric, why in (row.get("undefined") or {}).items():
                by_reason.setdefault(why, []).append(metric)
            for why, metrics in by_reason.items():
                lines.append(f"nan = undefined: {mode} {tensor}: {', '.join(metrics)}: {why}")
    return lines


def identical_text(comparison: dict) -> str:
    groups = comparison.get("identical_groups", [])
    if not groups:
        return "\nbit-identical modes: none (every mode differs from every other in some tensor)"
    return "\nbit-identical modes (every shared tensor equal bit for bit): " + "; ".join(
        " = ".join(g) for g in groups)


def short_comparison(comparison: dict, tensors: list[str]) -> str:
    """Compact table for the capture run: MSE, MAE, SQNR and max|err| per mode and tensor."""
    rows = []
    for mode, by_tensor in comparison["modes"].items():
        for tensor in tensors:
            row = by_tensor.get(tensor)
            if row is not None:
                rows.append([mode, tensor, fmt(row["mse"]), fmt(row["mae"]), fmt(row["sqnr_db"]), fmt(row["max_abs"]),
                             "yes" if row["identical"] else "no"])
    table = tabulate(rows, headers=("mode", "tensor", "MSE", "MAE", "SQNR dB", "max|err|", "identical"),
                     disable_numparse=True)
    notes = "".join(f"\n{line}" for line in undefined_notes(comparison))
    return f"\ncomparison against {comparison['reference']}:\n{table}{identical_text(comparison)}{notes}"
