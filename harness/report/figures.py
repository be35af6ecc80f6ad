"""Figures of the HTML report: matplotlib, no pyplot, no display, deterministic bytes.

Every public function takes plain numbers and arrays (no file, no manifest) and
returns a ``matplotlib.figure.Figure``, or None when it has nothing to draw (the
report then shows no figure for that data). Figures are built on ``Figure``
directly, so they never touch pyplot's global state or need a backend with a
display; ``render`` turns one into PNG or SVG bytes with fixed metadata (no
date, no software version, a fixed SVG id salt), so the same data always gives
the same bytes.

Arrays are errors d = mode - reference as float64, shaped [..., A, B]: A is the
token axis and B the channel axis, except for the final SSM state (A channel,
B state); `axes` names them. Leading axes (batch, and samples where a file has
several) are pooled.
"""
from __future__ import annotations

import io
import math
from contextlib import contextmanager
from typing import Iterator, Mapping, Sequence

import matplotlib
import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import LogFormatter, MaxNLocator, NullLocator

from .groups import array_key, equal_groups, group_label, keep_worst, series_key
from .html import MARK

__all__ = ["INT8_CLIP", "RC", "style", "render", "tensor_figure", "overflow_per_layer_figure", "error_histogram", "value_distribution",
           "error_vs_magnitude", "error_per_token", "error_per_channel", "taps_figure", "layer_sqnr_figure",
           "end_to_end_figure", "channel_profile", "mode_colors", "legend_outside", "new_figure", "log_axis"]

# Symmetric int8 with round-to-nearest: values beyond ±127.5·scale leave the grid
# (they round to ±128 and saturate at -128/127), so the clip lines sit there.
INT8_CLIP = 127.5
MAX_HEATMAP_COLUMNS = 512

# Fixed rendering settings: DejaVu Sans ships with matplotlib (no system font lookup,
# no web font), the SVG id salt makes ids reproducible, Agg draws without a display; no mathtext, no TeX.
RC = {"font.family": "DejaVu Sans", "font.size": 8.5, "axes.titlesize": 9, "svg.hashsalt": "quamba-harness",
      "svg.fonttype": "path", "figure.dpi": 80, "savefig.dpi": 80, "axes.grid": True, "grid.alpha": 0.3,
      "legend.fontsize": 7, "axes.prop_cycle": matplotlib.rcParamsDefault["axes.prop_cycle"],
      "text.parse_math": False, "text.usetex": False}  # names (modes, tensors) are drawn as text: $...$ is no math
_PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
            "#7f7f7f", "#bcbd22")
_METADATA = {"png": {"Software": MARK}, "svg": {"Date": None, "Creator": MARK}}  # no date, no version; the mark


def mode_colors(modes: Sequence[str]) -> dict[str, str]:
    """One fixed color per mode, by its position in the run."""
    return {m: _PALETTE[i % len(_PALETTE)] for i, m in enumerate(modes)}


_depth = 0


@contextmanager
def style() -> Iterator[None]:
    """The report's rc settings; re-entrant, so one context can wrap a whole report (rc_context copies
    every setting on entry and exit, which costs more than drawing a small figure)."""
    global _depth
    if _depth:
        yield
        return
    with matplotlib.rc_context(RC):
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1


def render(fig: Figure, fmt: str = "png") -> bytes:
    """PNG or SVG bytes of `fig`, with metadata that does not change between runs."""
    for ax in fig.axes:  # about 5 ticks per axis: tick labels are most of the drawing time
        for axis in (ax.xaxis, ax.yaxis):
            if isinstance(axis.get_major_locator(), MaxNLocator):
                axis.get_major_locator().set_params(nbins=5)
    buf = io.BytesIO()
    with style():
        fig.savefig(buf, format=fmt, metadata=_METADATA[fmt])
    return buf.getvalue()


def log_axis(axis) -> None:
    """A log axis with plain labels (1e+03) and no minor ticks: mathtext labels and minor ticks
    cost more than the rest of a panel."""
    axis.set_major_formatter(LogFormatter(labelOnlyBase=True))
    axis.set_minor_locator(NullLocator())


def _log_counts(ax, title: str, xlabel: str) -> None:
    """A histogram panel's log count axis, title and labels."""
    ax.set_yscale("log")
    log_axis(ax.yaxis)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("count (log)")


def new_figure(width: float, height: float, **margins) -> Figure:
    """A Figure with fixed margins (a layout engine would cost a second full draw per figure)."""
    with style():
        fig = Figure(figsize=(width, height))
    fig.subplots_adjust(**{"left": 0.07, "right": 0.97, "top": 0.88, "bottom": 0.12, **margins})
    return fig


def _finite(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    return x[np.isfinite(x)]


def _bins(arrays: Sequence[np.ndarray], n: int = 80) -> np.ndarray | None:
    vals = [a for a in (_finite(x) for x in arrays) if a.size]
    if not vals:
        return None
    lo, hi = min(float(v.min()) for v in vals), max(float(v.max()) for v in vals)
    if lo == hi:
        lo, hi = lo - 0.5, hi + 0.5
    return np.linspace(lo, hi, n + 1)


def _step(ax, values: np.ndarray, bins: np.ndarray, **kw) -> None:
    counts, edges = np.histogram(_finite(values), bins=bins)
    ax.stairs(counts, edges, **kw)


def error_histogram(ax, errors: Mapping[str, np.ndarray], colors: Mapping[str, str]) -> bool:
    """Histogram of d = mode - reference per mode, log count (outliers stay visible)."""
    bins = _bins(list(errors.values()))
    if bins is None:
        return False
    for mode, d in errors.items():
        _step(ax, d, bins, color=colors[mode], label=mode)
    _log_counts(ax, "error histogram (mode - reference)", "error")
    return True


def value_distribution(ax, reference: np.ndarray, values: Mapping[str, np.ndarray], colors: Mapping[str, str],
                       grids: Mapping[str, dict]) -> bool:
    """Reference values (filled) and each mode's values (lines), with each quantizing mode's clip lines
    at ±127.5·scale; the legend gives its saturated and clipped fractions.

    grids: mode -> {"scale": s, "saturated_fraction": f or None, "clipped_fraction": f or None}.
    """
    clips = [INT8_CLIP * g["scale"] for g in grids.values() if g.get("scale")]
    bins = _bins([reference, *values.values(), np.asarray(clips + [-c for c in clips])])
    if bins is None:
        return False
    counts, edges = np.histogram(_finite(reference), bins=bins)
    ax.stairs(counts, edges, fill=True, color="#bbbbbb", label="reference")
    for mode, v in values.items():
        _step(ax, v, bins, color=colors[mode])
    for mode, g in grids.items():
        if not g.get("scale"):
            continue
        clip = INT8_CLIP * float(g["scale"])
        parts = [f"±{clip:.4g}"]
        for key, word in (("saturated_fraction", "sat"), ("clipped_fraction", "clip")):
            if g.get(key) is not None:
                parts.append(f"{word} {100 * g[key]:.3g}%")
        ax.axvline(-clip, color=colors[mode], linestyle="--", linewidth=1)
        ax.axvline(clip, color=colors[mode], linestyle="--", linewidth=1, label=f"{mode} grid " + ", ".join(parts))
    _log_counts(ax, "values and int8 clip lines (±127.5·scale)" if clips else
                "values (float in every mode shown: no int8 grid, no clip lines)", "value")
    return True


def error_vs_magnitude(ax, reference: np.ndarray, errors: Mapping[str, np.ndarray], colors: Mapping[str, str],
                       n_bins: int = 40) -> bool:
    """Mean |error| against the reference's |value|, in bins of equal count (quantile edges; equal values
    share a bin); all elements, no sampling."""
    mag = np.abs(np.asarray(reference, dtype=np.float64).reshape(-1))
    ok = np.isfinite(mag)
    if not ok.any() or not errors:
        return False
    edges = np.unique(np.quantile(mag[ok], np.linspace(0.0, 1.0, n_bins + 1)))
    idx = np.clip(np.searchsorted(edges, mag, side="right") - 1, 0, max(0, edges.size - 2))
    count = np.bincount(idx[ok], minlength=max(1, edges.size - 1))
    has = count > 0
    centers = np.bincount(idx[ok], mag[ok], minlength=count.size)[has] / count[has]
    for mode, d in errors.items():
        ad = np.abs(np.asarray(d, dtype=np.float64).reshape(-1))[ok]
        ax.plot(centers, np.bincount(idx[ok], ad, minlength=count.size)[has] / count[has], marker=".",
                color=colors[mode], label=mode)
    ax.set_title("mean |error| vs reference magnitude")
    ax.set_xlabel("|reference value| (equal-count bins)")
    ax.set_ylabel("mean |error|")
    return True


def _rms(d: np.ndarray, keep: int) -> np.ndarray:
    d = np.asarray(d, dtype=np.float64)  # the last two axes are (token, channel); any leading ones (batch,
    d = d.reshape((1,) * (3 - d.ndim) + d.shape) if d.ndim < 3 else d.reshape(-1, *d.shape[-2:])  # samples) merge
    axes = tuple(i for i in range(3) if i != keep)
    return np.sqrt(np.mean(d * d, axis=axes))


def error_per_token(ax, errors: Mapping[str, np.ndarray], colors: Mapping[str, str], axis_name: str = "token") -> bool:
    """RMS error per token (the second-to-last axis), over the other axes; one line per mode."""
    if not errors:
        return False
    for mode, d in errors.items():
        ax.plot(_rms(d, 1), color=colors[mode], linewidth=0.9, label=mode)
    ax.set_title(f"RMS error per {axis_name}")
    ax.set_xlabel(axis_name)
    ax.set_ylabel("RMS error")
    return True


def channel_profile(d: np.ndarray, max_columns: int = MAX_HEATMAP_COLUMNS) -> np.ndarray:
    """RMS error per channel (last axis), averaged over contiguous groups when there are more than max_columns."""
    prof = _rms(d, 2)
    if prof.size > max_columns:
        groups = np.array_split(np.arange(prof.size), max_columns)
        prof = np.array([np.sqrt(np.mean(prof[g] ** 2)) for g in groups])
    return prof


def error_per_channel(ax, errors: Mapping[str, np.ndarray], axis_name: str = "channel") -> bool:
    """Heatmap of RMS error, modes x channels (over batch and tokens): outlier channels show as columns."""
    if not errors:
        return False
    rows = [channel_profile(d) for d in errors.values()]
    width = min(r.size for r in rows)
    image = ax.imshow(np.stack([r[:width] for r in rows]), aspect="auto", interpolation="nearest", cmap="viridis")
    ax.set_yticks(range(len(rows)), list(errors))
    ax.set_title(f"RMS error per {axis_name}")
    ax.set_xlabel(axis_name + (" (grouped)" if width < _rms(next(iter(errors.values())), 2).size else ""))
    ax.grid(False)
    ax.figure.colorbar(image, ax=ax, shrink=0.8)
    return True


def tensor_figure(title: str, reference: np.ndarray, values: Mapping[str, np.ndarray], colors: Mapping[str, str],
                  grids: Mapping[str, dict] | None = None, axes: tuple[str, str] = ("token", "channel")) -> Figure | None:
    """The per-tensor panel: error histogram, values with clip lines, error vs magnitude, error per token
    and per channel, for every mode in `values` that differs from the reference. Modes with equal arrays
    are drawn once, named together; at most MAX_SERIES groups (the largest RMS error); one legend, right
    of the panels."""
    ref = np.asarray(reference, dtype=np.float64)
    differing = {m: v for m, v in values.items() if np.shape(v) == ref.shape and not np.array_equal(v, reference)}
    if ref.size == 0 or not differing:
        return None
    groups = equal_groups({m: array_key(np.asarray(v)) for m, v in differing.items()})
    rms = {h: float(np.sqrt(np.mean((np.asarray(differing[h], dtype=np.float64) - ref) ** 2))) for h in groups}
    groups, left_out = keep_worst(groups, rms)
    label = {h: group_label(members) for h, members in groups.items()}
    errors = {label[h]: np.asarray(differing[h], dtype=np.float64) - ref for h in groups}
    shown = {label[h]: differing[h] for h in groups}
    tints = {label[h]: colors[h] for h in groups}
    fig = new_figure(12.5, 6.6, left=0.06, right=0.8, top=0.91, bottom=0.08, hspace=0.42, wspace=0.45)
    grid = fig.add_gridspec(2, 3)
    error_histogram(fig.add_subplot(grid[0, 0]), errors, tints)
    value_distribution(fig.add_subplot(grid[0, 1]), ref, shown, tints,
                       {label[h]: g for h, g in (grids or {}).items() if h in label})
    error_vs_magnitude(fig.add_subplot(grid[0, 2]), ref, errors, tints)
    error_per_token(fig.add_subplot(grid[1, 0:2]), errors, tints, axes[0])
    error_per_channel(fig.add_subplot(grid[1, 2]), errors, axes[1])
    handles, names = fig.axes[0].get_legend_handles_labels()
    more, more_names = fig.axes[1].get_legend_handles_labels()
    fig.legend(handles + more, names + more_names, loc="upper left", bbox_to_anchor=(0.81, 0.91), fontsize=6.5,
               title=f"{left_out} more modes not drawn" if left_out else None)
    fig.suptitle(title)
    return fig


def _grouped_bars(ax, labels: Sequence[str], series: Mapping[str, Sequence[float]], colors: Mapping[str, str]) -> None:
    width = 0.8 / max(1, len(series))
    x = np.arange(len(labels))
    for i, (mode, vals) in enumerate(series.items()):
        ax.bar(x + (i - (len(series) - 1) / 2) * width, [v if v is not None else 0.0 for v in vals], width,
               color=colors[mode], label=mode)
    ax.set_xticks(x, labels, rotation=30, ha="right")


def taps_figure(title: str, taps: Mapping[str, Mapping[str, dict]], colors: Mapping[str, str]) -> Figure | None:
    """Per internal tap (x) and mode (bars): saturated fraction, clipped (overflow) fraction, scale.

    taps: tap -> mode -> {"scale", "saturated_fraction", "clipped_fraction"} of the int8 tensors.
    """
    labels = [t for t, by_mode in taps.items() if any(e.get("scale") for e in by_mode.values())]
    if not labels:
        return None
    modes = [m for m in colors if any(m in taps[t] for t in labels)]
    fig = new_figure(12.5, 7.5, top=0.92, bottom=0.13, hspace=0.35)
    panels = (("saturated_fraction", "saturated fraction (codes at -128 or 127)", "linear"),
              ("clipped_fraction", "clipped fraction (values beyond ±127.5·scale)", "linear"),
              ("scale", "scale", "log"))
    axs = fig.subplots(3, 1, sharex=True)
    for ax, (key, name, yscale) in zip(axs, panels):
        series = {m: [taps[t].get(m, {}).get(key) for t in labels] for m in modes}
        _grouped_bars(ax, labels, series, colors)
        ax.set_ylabel(name if key == "scale" else "fraction")
        ax.set_title(name)
        if yscale == "log" and any(v for vals in series.values() for v in vals if v):
            ax.set_yscale("log")
            log_axis(ax.yaxis)
    axs[0].legend(loc="upper right", ncols=min(len(modes), 8))
    fig.suptitle(title)
    return fig


def overflow_per_layer_figure(layers: Sequence[int], saturated: Mapping[str, Sequence[float | None]],
                              clipped: Mapping[str, Sequence[float | None]], colors: Mapping[str, str]) -> Figure | None:
    """Per layer and mode, the largest saturated and clipped fraction over the layer's int8 taps."""
    if len(layers) < 2 or not (saturated or clipped):
        return None
    fig = new_figure(12.5, 3.6, bottom=0.15, top=0.84, wspace=0.22)
    axs = fig.subplots(1, 2)
    for ax, series, name in ((axs[0], saturated, "largest saturated fraction over the taps"),
                             (axs[1], clipped, "largest clipped fraction over the taps")):
        for mode, vals in series.items():
            ax.plot(layers, [np.nan if v is None else v for v in vals], marker="o", markersize=3, color=colors[mode],
                    label=mode)
        ax.set_title(name)
        ax.set_xlabel("layer")
        if len(layers) <= 32:
            ax.set_xticks(list(layers))
    axs[0].set_ylabel("fraction")
    axs[0].legend(loc="best", ncols=2)
    return fig


def legend_outside(ax, left_out: int = 0, **kw) -> None:
    """The legend right of the axes, off the data; says how many modes were not drawn."""
    title = f"{left_out} more modes not drawn" if left_out else None
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, title=title, **kw)


def layer_sqnr_figure(layers: Sequence[int], accumulated: Mapping[str, Sequence[float]],
                      isolated: Mapping[str, Sequence[float]], colors: Mapping[str, str]) -> Figure | None:
    """SQNR (dB) per layer for each mode: accumulated (solid) and isolated (dashed) on one chart. Modes whose
    lines would coincide are drawn once, named together ("2-0 = 2-1"); at most MAX_SERIES groups (the lowest
    SQNR), the legend right of the axes."""
    if len(layers) < 2 or not (accumulated or isolated):
        return None
    modes = [m for m in colors if m in accumulated or m in isolated]
    groups = equal_groups({m: (series_key(accumulated.get(m)), series_key(isolated.get(m))) for m in modes})
    lowest = {h: -min([v for v in (*accumulated.get(h, ()), *isolated.get(h, ())) if v is not None and math.isfinite(v)]
                      or [math.inf]) for h in groups}
    groups, left_out = keep_worst(groups, lowest)
    fig = new_figure(12.5, 4.2, bottom=0.13, top=0.9, left=0.06, right=0.74)
    ax = fig.add_subplot()
    for head, members in groups.items():
        for series, style, word in ((accumulated, "-", "accumulated"), (isolated, "--", "isolated")):
            if head in series:
                y = [v if v is not None and math.isfinite(v) else np.nan for v in series[head]]
                ax.plot(layers, y, style, marker="o", markersize=3, color=colors[head],
                        label=f"{group_label(members)} {word}")
    if len(layers) <= 32:
        ax.set_xticks(list(layers))
    ax.set_title("SQNR per layer (block output against the reference; higher is better)")
    ax.set_xlabel("layer")
    ax.set_ylabel("SQNR (dB)")
    legend_outside(ax, left_out)
    return fig


def _mean_ci(value) -> tuple[float | None, tuple[float, float] | None]:
    """A number, or {"mean" (or "mean_diff"): m, "ci95": [lo, hi]}; strings "inf"/"nan" as JSON writes them."""
    def num(v):
        try:
            return float(v)
        except (TypeError, ValueError):
            return None
    if isinstance(value, dict):
        ci = value.get("ci95")
        return (num(value.get("mean", value.get("mean_diff"))),
                (num(ci[0]), num(ci[1])) if isinstance(ci, (list, tuple)) and len(ci) == 2 else None)
    return num(value), None


def _bars_with_ci(ax, modes: Sequence[str], values: Sequence, colors: Mapping[str, str]) -> None:
    means, lows, highs = [], [], []
    for v in values:
        m, ci = _mean_ci(v)
        means.append(np.nan if m is None else m)
        lows.append(0.0 if ci is None or m is None or ci[0] is None else m - ci[0])
        highs.append(0.0 if ci is None or m is None or ci[1] is None else ci[1] - m)
    ax.bar(range(len(modes)), means, color=[colors[m] for m in modes], yerr=[lows, highs], capsize=3)
    ax.set_xticks(range(len(modes)), modes, rotation=30, ha="right")


# perplexity itself is not drawn: bars from 0 hide differences of a fraction of a percent; its paired
# difference to the reference is (docs/analysis.md)
_E2E = (("kl", "mean KL(reference ‖ mode)"), ("top1_agreement", "top-1 agreement"),
        ("perplexity_diff", "perplexity − reference (paired)"))


def end_to_end_figure(end_to_end: Mapping[str, Mapping], colors: Mapping[str, str]) -> Figure | None:
    """KL, top-1 agreement and the paired perplexity difference per mode (bars; 95 % intervals where given)."""
    panels = [(k, name) for k, name in _E2E if any(k in e for e in end_to_end.values())]
    if not panels:
        return None
    fig = new_figure(12.5, 3.8, bottom=0.22, top=0.82, wspace=0.25)
    axs = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (key, name) in zip(axs, panels):
        modes = [m for m in colors if key in end_to_end.get(m, {})]
        _bars_with_ci(ax, modes, [end_to_end[m][key] for m in modes], colors)
        if key == "perplexity_diff":
            ax.axhline(0.0, color="#444444", linewidth=0.8)
        ax.set_title(name)
    fig.suptitle("end to end (final norm and lm_head included)")
    return fig
