"""Text output: per-mode summaries (the research tool's layout) and comparison tables (tabulate)."""
from __future__ import annotations

import math

from tabulate import tabulate

from ..metrics.ranking import ORDER_TEXT, rank_layers

__all__ = ["IDENTICAL_NOTE", "mode_summary", "comparison_tables", "short_comparison", "fmt", "undefined_notes",
           "end_to_end_table", "sensitivity_tables", "sensitivity_rankings", "generation_table",
           "at_header", "pooled_note", "failed_lines", "sample_mean_table"]

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


def at_header(tensor: str, ndim: int) -> str:
    """The `at` column's heading: what each index of max|err|'s position is (b batch, t token, c channel;
    with several samples a leading sample index; the SSM state is [batch, channel, state])."""
    axes = ("b", "c", "state") if tensor.endswith("ssm.state") else ("b", "t", "vocab") if tensor == "logits" \
        else ("b", "t", "c")
    if ndim == len(axes) + 1:
        axes = ("sample", *axes)
    return f"at ({', '.join(axes)})" if ndim == len(axes) else "at (index)"


def pooled_note(samples: int | None) -> str:
    """The line that says a table's metrics pool every sample (one array of all windows)."""
    if not samples or samples < 2:
        return ""
    return (f"\nPooled over the {samples} samples: each metric takes the {samples} windows together as one array "
            "(per-sample means with 95 % intervals: the samples section of the stats; SQNR below)")


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


def comparison_tables(comparison: dict, titles: dict[str, str] | None = None, samples: int | None = None) -> str:
    """One table per tensor: every mode against the reference, MSE and MAE first (samples > 1: said pooled)."""
    titles = titles or {}
    ref = comparison["reference"]
    out = [pooled_note(samples)] if pooled_note(samples) else []
    for tensor in _tensor_order(comparison):
        rows = _rows(comparison, tensor, titles)
        ndim = next((len(r["max_abs_index"]) for r in (by.get(tensor) for by in comparison["modes"].values())
                     if r is not None), 3)
        out.append(f"\n{tensor} vs {ref} (d = mode - {ref}{', pooled over the samples' if pooled_note(samples) else ''})")
        out.append(tabulate(rows, headers=[at_header(tensor, ndim) if h == _HEADERS[5] else h for h in _HEADERS],
                            disable_numparse=True))
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


# Why modes can be bit-identical: equal in the tensors captured, not necessarily inside the block.
IDENTICAL_NOTE = ("equal in the tensors captured only: modes whose internal taps differ can still give equal "
                  "layer outputs (2-1 and 2-2's scans differ by an fp16 ulp at ssm.out that the int8 had.out "
                  "absorbs); --taps all shows the internal taps (docs/modes.md, \"Equal outputs\")")


def identical_text(comparison: dict) -> str:
    groups = comparison.get("identical_groups", [])
    if not groups:
        return "\nbit-identical modes: none (every mode differs from every other in some tensor)"
    return ("\nbit-identical modes (every shared tensor equal bit for bit): " + "; ".join(
        " = ".join(g) for g in groups) + f"\n  note: {IDENTICAL_NOTE}")


def failed_lines(failed: dict[str, dict], reference: str) -> list[str]:
    """compare's lines for the modes the capture recorded as failed: the error and the tensors missing."""
    return [f"mode {mode} FAILED in the capture ({entry['error']}); tensors of {reference} it has no array for: "
            f"{', '.join(entry['missing']) or 'none'}" for mode, entry in failed.items()]


def sample_mean_table(samples: dict, modes: list[str], tensors: list[str] | None = None,
                      metric: str = "sqnr_db") -> str:
    """stats["samples"]: the per-sample mean of `metric` with its 95 % interval, per mode and tensor
    (block tensors and logits only unless `tensors` names others)."""
    metrics = samples.get("metrics") if isinstance(samples.get("metrics"), dict) else {}
    rows = []
    for mode in modes:
        for tensor, by_metric in (metrics.get(mode) or {}).items():
            keep = tensor in tensors if tensors else (tensor in ("input", "output", "residual")
                                                      or ".block." in tensor)
            if keep and isinstance(by_metric, dict) and isinstance(by_metric.get(metric), dict):
                rows.append([mode, tensor, _value(by_metric[metric])])
    if not rows:
        return ""
    return (f"\n{metric} per sample: mean [95 % CI] over the {samples.get('count')} samples (Student t)\n"
            + tabulate(rows, headers=["mode", "tensor", f"{metric} mean [95 % CI]"], disable_numparse=True))


def short_comparison(comparison: dict, tensors: list[str], samples: int | None = None) -> str:
    """Compact table for the capture run: MSE, MAE, SQNR and max|err| per mode and tensor (pooled over the
    samples when several ran: the table says so)."""
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
    pooled = ", pooled over the samples" if pooled_note(samples) else ""
    return (f"{pooled_note(samples)}\ncomparison against {comparison['reference']}{pooled}:\n{table}"
            f"{identical_text(comparison)}{notes}")


def _value(v) -> str:
    if isinstance(v, dict) and ("mean" in v or "mean_diff" in v):
        lo, hi = (v.get("ci95") or [None, None])[:2]
        return f"{fmt(v.get('mean', v.get('mean_diff')))} [{fmt(lo)}, {fmt(hi)}]"
    if isinstance(v, dict) and "pooled" in v:
        w = v.get("per_window") or {}
        return f"{fmt(v['pooled'])} (windows {fmt(w.get('min'))} to {fmt(w.get('max'))})"
    return fmt(v)


def end_to_end_table(e2e: dict, reference: str) -> str:
    """stats["end_to_end"] as a table: KL(ref || mode), top-1 agreement, cross-entropy, perplexity and the
    paired perplexity difference to the reference (docs/analysis.md)."""
    rows = [[m, _value(v.get("kl")), _value(v.get("top1_agreement")), _value(v.get("cross_entropy")),
             _value(v.get("perplexity")), _value(v.get("perplexity_diff"))] for m, v in e2e.items()]
    several = any(isinstance(v.get("perplexity"), dict) for v in e2e.values())
    note = ("\n(mean [95 % CI] over samples; perplexity = exp(mean NLL over every predicted token of every window), "
            f"with the range of the windows' own; perplexity - {reference}: mean of the per-window differences "
            "[paired 95 % CI])") if several else ""
    return (f"\nEnd to end against {reference}:{note}\n"
            + tabulate(rows, headers=["mode", "KL(ref||mode)", "top-1 agreement", "cross-entropy (nats)",
                                      "perplexity", f"perplexity - {reference}"], disable_numparse=True))


def _snippet(text: str, width: int = 60) -> str:
    """Generated text on one table line: newlines and tabs shown escaped, cut to `width` characters."""
    one = text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")
    return one if len(one) <= width else one[: width - 3] + "..."


def _diverged(gen: dict) -> tuple[str, str]:
    """(first divergence, agreement) of a mode's generation: "none" when every token is the reference's,
    "n/a" when there was no reference's to compare with."""
    if "agreement" not in gen:
        return "n/a", "n/a"
    first = gen.get("first_divergence")
    return ("none" if first is None else str(first)), fmt(gen["agreement"])


def generation_table(modes: dict, reference: str) -> str:
    """--generate N: per mode the first step whose token leaves the reference's, the agreement and the start of
    the generated text (stats["modes"][m]["generate"]); "" when no mode generated."""
    rows = [[m, *(("-", "-") if m == reference else _diverged(g)), _snippet(g.get("text", ""))]
            for m, e in modes.items() if (g := e.get("generate")) is not None]
    if not rows:
        return ""
    n = len(next(e["generate"]["ids"] for e in modes.values() if e.get("generate") is not None))
    return (f"\nGeneration ({n} greedy tokens after the prompt) against {reference}:\n"
            + tabulate(rows, headers=["mode", "first divergence (step)", "agreement", "generated text"],
                       disable_numparse=True))


_SENS_COLUMNS = (("layer", "layer"), ("kl", "KL alone"), ("kl_share", "share of mode's KL"),
                 ("isolated_sqnr_db", "isolated SQNR dB"), ("accumulated_sqnr_db", "accumulated SQNR dB"))


def _block_layer(tensor: str) -> int | None:
    if tensor == "output":
        return 0
    if tensor.startswith("L") and tensor.endswith((".block.isolated", ".block.out")):
        head = tensor.split(".")[0][1:]
        return int(head) if head.isdigit() else None
    return None


def sensitivity_rankings(comparison: dict | None, sensitivity: dict | None,
                         layers: set[int] | None = None) -> dict[str, dict]:
    """MODE -> {"ranked_by", "order", "layers": rows most harmful first} (metrics.ranking), from the compared
    block outputs and stats["sensitivity"]; `layers` keeps only those layers (compare --tensors)."""
    modes = dict((comparison or {}).get("modes", {}))
    out = {}
    for mode in list(dict.fromkeys(list(modes) + list(sensitivity or {}))):
        by_layer = (sensitivity or {}).get(mode) or {}
        rows_of = modes.get(mode, {})
        found = {_block_layer(t) for t in rows_of} | {int(k) for k in by_layer if str(k).isdigit()}
        found = sorted(i for i in found if i is not None and (layers is None or i in layers))
        rows = []
        for layer in found:
            kl = by_layer.get(str(layer)) or {}
            rows.append({"layer": layer, "kl": kl.get("kl"), "kl_share": kl.get("kl_share"),
                         "isolated_sqnr_db": rows_of.get(f"L{layer}.block.isolated", {}).get("sqnr_db"),
                         "accumulated_sqnr_db": rows_of.get("output" if layer == 0 else f"L{layer}.block.out",
                                                            {}).get("sqnr_db")})
        if not rows or len(rows) < 2 and not by_layer:
            continue
        key, ranked = rank_layers(rows)
        if key is not None:
            out[mode] = {"ranked_by": key, "order": ORDER_TEXT[key], "layers": ranked}
    return out


def sensitivity_tables(comparison: dict | None, sensitivity: dict | None, reference: str,
                       layers: set[int] | None = None) -> str:
    """Per mode, the captured layers most harmful first: by the KL of each layer alone where --sensitivity
    measured it, else by isolated SQNR, else by accumulated SQNR; the heading says which."""
    parts = []
    for mode, ranking in sensitivity_rankings(comparison, sensitivity, layers).items():
        rows = ranking["layers"]
        cols = [(k, h) for k, h in _SENS_COLUMNS if k == "layer" or any(r[k] is not None for r in rows)]
        parts.append(f"\nSensitivity of mode {mode} against {reference} ({ranking['order']}):\n"
                     + tabulate([[r[k] if k == "layer" else fmt(r[k]) for k, _ in cols] for r in rows],
                                headers=[h for _, h in cols], disable_numparse=True))
    return "".join(parts)
