"""Text output: per-mode summaries (the research tool's layout) and comparison tables (tabulate)."""
from __future__ import annotations

import math

from tabulate import tabulate

__all__ = ["mode_summary", "comparison_tables", "short_comparison", "fmt", "undefined_notes", "end_to_end_table",
           "sensitivity_tables"]

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
    names: dict[str, None] = {}       # a dict, not a list: linear in modes x tensors
    for by_tensor in comparison["modes"].values():
        names.update(dict.fromkeys(by_tensor))
    return list(names)


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


def _value(v) -> str:
    if isinstance(v, dict) and "mean" in v:
        lo, hi = v.get("ci95", [None, None])
        return f"{fmt(v['mean'])} [{fmt(lo)}, {fmt(hi)}]"
    return fmt(v)


def end_to_end_table(e2e: dict, reference: str) -> str:
    """stats["end_to_end"] as a table: KL(ref || mode), top-1 agreement, cross-entropy, perplexity."""
    rows = [[m, _value(v.get("kl")), _value(v.get("top1_agreement")), _value(v.get("cross_entropy")),
             _value(v.get("perplexity"))] for m, v in e2e.items()]
    return (f"\nEnd to end against {reference} (mean [95 % CI] over samples where several ran):\n"
            + tabulate(rows, headers=["mode", "KL(ref||mode)", "top-1 agreement", "cross-entropy (nats)",
                                      "perplexity"], disable_numparse=True))


def sensitivity_tables(comparison: dict | None, sensitivity: dict | None, reference: str) -> str:
    """Per mode, the captured layers ranked by isolated SQNR (lowest first; accumulated SQNR where the file
    has no isolated outputs) with the share of the end-to-end KL each explains alone (--sensitivity)."""
    modes = dict((comparison or {}).get("modes", {}))
    parts = []
    for mode in list(dict.fromkeys(list(modes) + list(sensitivity or {}))):
        rows = []
        by_layer = (sensitivity or {}).get(mode, {})
        layers = sorted({int(t.split(".")[0][1:]) for t in modes.get(mode, {}) if t.startswith("L") and
                         t.endswith((".block.isolated", ".block.out"))} | ({0} if "output" in modes.get(mode, {}) else set())
                        | {int(k) for k in by_layer})
        for layer in layers:
            rows_of = modes.get(mode, {})
            iso = rows_of.get(f"L{layer}.block.isolated", {}).get("sqnr_db")
            acc = rows_of.get("output" if layer == 0 else f"L{layer}.block.out", {}).get("sqnr_db")
            kl = by_layer.get(str(layer), {})
            rows.append([layer, iso, acc, kl.get("kl"), kl.get("kl_share")])
        if not rows or len(rows) < 2 and not by_layer:
            continue
        key = 1 if any(r[1] is not None for r in rows) else 2
        rows.sort(key=lambda r: (r[key] is None, r[key] if isinstance(r[key], (int, float)) else 0.0, r[0]))
        parts.append(f"\nSensitivity of mode {mode} against {reference} (layers ranked by "
                     f"{'isolated' if key == 1 else 'accumulated'} SQNR, worst first):\n"
                     + tabulate([[fmt(c) if not isinstance(c, int) else c for c in r] for r in rows],
                                headers=["layer", "isolated SQNR dB", "accumulated SQNR dB", "KL alone",
                                         "share of mode's KL"], disable_numparse=True))
    return "".join(parts)
