"""The "Across samples" section: one chart of the block tensors' SQNR over samples, only where modes differ.

A tensor whose mean SQNR is the same (to the 4 digits shown) in every mode says nothing about the modes
(e.g. the model's input, 70 dB in every mode): it gets no chart, only a line saying so. Modes whose
per-sample values are equal in every tensor are one column and one series ("2-0 = 2-1"). SQNR alone is
drawn: rel L2 is 10^(-SQNR/20) per sample, and MSE the same up to the reference's power.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure

from .data import BLOCK_SITES, ReportData, as_float, layer_and_site
from .figures import new_figure, legend_outside
from .groups import equal_groups, group_label, identical_of, keep_worst
from .html import esc, fmt_value, section, table

__all__ = ["samples_figure", "samples_section", "mean_ci"]

METRIC = "sqnr_db"


def mean_ci(value) -> tuple[float | None, tuple[float | None, float | None] | None]:
    """(mean, (lo, hi) or None) of a number or {"mean": m, "ci95": [lo, hi]}."""
    if isinstance(value, dict):
        ci = value.get("ci95")
        pair = (as_float(ci[0]), as_float(ci[1])) if isinstance(ci, (list, tuple)) and len(ci) == 2 else None
        return as_float(value.get("mean")), pair
    return as_float(value), None


def samples_figure(tensors: Sequence[str], series: Mapping[str, Sequence], colors: Mapping[str, str],
                   n_samples: int | None = None, left_out: int = 0) -> Figure | None:
    """Mean SQNR with its 95 % interval per tensor (x) for each series (label -> one value per tensor)."""
    if not tensors or not series:
        return None
    fig = new_figure(12.5, 3.8, left=0.06, right=0.74, bottom=0.3, top=0.88)
    ax = fig.add_subplot()
    x = np.arange(len(tensors))
    width = 0.7 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        parsed = [mean_ci(v) for v in values]
        means = np.array([np.nan if m is None else m for m, _ in parsed])
        low = [0.0 if ci is None or m is None or ci[0] is None else m - ci[0] for m, ci in parsed]
        high = [0.0 if ci is None or m is None or ci[1] is None else ci[1] - m for m, ci in parsed]
        ax.errorbar(x + (i - (len(series) - 1) / 2) * width, means, yerr=[low, high], fmt="o", markersize=3.5,
                    capsize=3, color=colors[label], label=label)
    ax.set_xticks(x, list(tensors), rotation=30, ha="right")
    ax.set_ylabel("SQNR (dB)")
    ax.set_title("SQNR, mean and 95 % CI" + (f" over {n_samples} samples" if n_samples else "")
                 + " (tensors where the modes differ)")
    legend_outside(ax, left_out)
    return fig


def _by_mode(d: ReportData, metrics: dict) -> tuple[list[str], dict[str, dict[str, object]]]:
    """(block tensors in order, mode -> tensor -> SQNR entry) of the modes other than the reference."""
    tensors = list(dict.fromkeys(t for by in metrics.values() if isinstance(by, dict) for t in by))
    tensors = [t for t in tensors if layer_and_site(t)[1] in BLOCK_SITES]
    out = {}
    for mode, by in metrics.items():
        if mode == d.reference or not isinstance(by, dict):
            continue
        row = {t: by[t][METRIC] for t in tensors if isinstance(by.get(t), dict) and METRIC in by[t]}
        if row:
            out[mode] = row
    return tensors, out


def _cell(value) -> str:
    m, ci = mean_ci(value)
    return fmt_value(m) + (f" [{fmt_value(ci[0])}, {fmt_value(ci[1])}]" if ci else "")


def _pairs(d: ReportData, s: dict) -> str:
    """The paired differences, once per pair of groups of bit-identical modes (a pair inside a group is 0)."""
    group = identical_of(d.comparison, list(dict.fromkeys(d.modes + [str(p.get("a")) for p in s.get("pairs") or []
                                                                         if isinstance(p, dict)])))
    rows, seen, inside = [], set(), 0
    for p in s.get("pairs") or []:
        if not isinstance(p, dict):
            continue
        a, b = group.get(str(p.get("a")), [str(p.get("a"))]), group.get(str(p.get("b")), [str(p.get("b"))])
        key = (a[0], b[0], str(p.get("tensor", "")), str(p.get("metric")))
        if a == b or key in seen:
            inside += a == b
            continue
        seen.add(key)
        rows.append([group_label(a), group_label(b), p.get("tensor", ""), p.get("metric"), as_float(p.get("mean_diff")),
                     *[as_float(x) for x in (p.get("ci95") or [None, None])]])
    if not rows:
        return ""
    note = (f'<p class="note">Bit-identical modes (a = b) are one row; {inside} pairs of bit-identical modes '
            "(difference 0) are left out.</p>" if inside else "")
    return ("<h3>Pairs of modes: mean difference (a &minus; b) with 95 % CI</h3>" + note
            + table(["a", "b", "tensor", "metric", "mean diff", "CI low", "CI high"], rows, left=4))


def _sqnr_parts(s: dict, figs, colors: dict, tensors: list[str], by_mode: dict) -> list[str]:
    """The chart (tensors where modes differ), the line naming the others, the folded table."""
    groups = equal_groups({m: tuple(repr(row.get(t)) for t in tensors) for m, row in by_mode.items()})
    worst = {h: -min([m for t in tensors if (m := mean_ci(by_mode[h].get(t))[0]) is not None] or [np.inf])
             for h in groups}
    groups, left_out = keep_worst(groups, worst)
    label = {h: group_label(members) for h, members in groups.items()}
    several = len(by_mode) > 1           # one mode: its numbers are the table; a chart would compare nothing
    shown = {t: {fmt_value(mean_ci(row.get(t))[0]) for row in by_mode.values()} for t in tensors}
    differ = [t for t in tensors if several and len(shown[t]) > 1]
    same = [t for t in tensors if several and t not in differ and any(t in row for row in by_mode.values())]
    series = {label[h]: [by_mode[h].get(t) for t in differ] for h in groups}
    fig = samples_figure(differ, series, {label[h]: colors.get(h, "#777777") for h in groups}, s.get("count"),
                         left_out)
    parts = [figs.embed("samples_sqnr", fig, "SQNR per tensor with 95 % CI")]
    if same:
        parts.append('<p class="note">The same mean SQNR in every mode (no chart): '
                     + esc("; ".join(f"{t} {_cell(next(r[t] for r in by_mode.values() if t in r))} dB"
                                     for t in same)) + ".</p>")
    rows = [[t, *[_cell(by_mode[h].get(t)) if t in by_mode[h] else None for h in groups]] for t in tensors]
    parts.append(f"<details{'' if several else ' open'}><summary>SQNR dB per tensor: mean [95 % CI]</summary>"
                 + table(["tensor", *label.values()], rows) + "</details>")
    return parts


def samples_section(d: ReportData, figs, colors: dict) -> str:
    s = d.samples()
    metrics = s.get("metrics") if isinstance(s.get("metrics"), dict) else {}
    tensors, by_mode = _by_mode(d, metrics)
    parts = _sqnr_parts(s, figs, colors, tensors, by_mode) if by_mode else []
    parts.append(_pairs(d, s))
    if not "".join(parts):
        return ""
    n = s.get("count")
    return section("Across samples", "".join(parts), "samples",
                   f"Mean over {esc(n) if n else 'the'} samples with 95 % confidence intervals: SQNR of the block "
                   "tensors (rel L2 and MSE per sample are in the stats file, samples.metrics).")
