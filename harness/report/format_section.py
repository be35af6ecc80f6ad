"""The report's "Number formats" section (`python -m harness report FILE --formats [F ...]`): the reference
mode's tensors represented in each format (harness.metrics.formats): error per format per tensor, the overflow,
underflow and saturated fractions by format, and the value histograms of one tensor under each format."""
from __future__ import annotations

import numpy as np
import torch
from matplotlib.figure import Figure

from ..kernels.formats import fake_quantize
from ..metrics.formats import empty_tensor, format_errors, not_applicable, reference
from .data import ReportData
from .figures import log_axis
from .html import esc, section, table
from .sections import Figures

__all__ = ["DEFAULT_REPORT_FORMATS", "format_section"]

DEFAULT_REPORT_FORMATS = ("bf16", "hifp8", "fp8_e4m3", "mxfp8_e4m3", "mxfp4_e2m1", "nvfp4", "int8")
MAX_TENSORS = 12
_RATES = ("overflow", "underflow", "saturated")


def _rates_figure(rows: dict[str, dict[str, dict]], formats: list[str]) -> Figure | None:
    """SQNR per format (one bar group per tensor) and the worst overflow / underflow / saturated fraction."""
    tensors = [t for t in rows if any("mse" in rows[t][f] for f in formats)]
    if not tensors:
        return None
    fig = Figure(figsize=(10, 3.6))
    ax_q, ax_r = fig.subplots(1, 2)
    x = np.arange(len(formats))
    width = 0.8 / len(tensors)
    for k, t in enumerate(tensors):
        sq = [rows[t][f].get("sqnr_db", np.nan) for f in formats]
        ax_q.bar(x + k * width, np.nan_to_num(np.asarray(sq, float), posinf=0.0, neginf=0.0), width, label=t)
    ax_q.set_xticks(x + 0.4 - width / 2, formats, rotation=40, ha="right")
    ax_q.set_ylabel("SQNR (dB)")
    ax_q.set_title("error per format and tensor")
    if len(tensors) <= 8:
        ax_q.legend(fontsize=7)
    for k, rate in enumerate(_RATES):
        worst = [max((rows[t][f].get(rate) or 0.0 for t in tensors), default=0.0) * 100 for f in formats]
        ax_r.bar(x + k * 0.27, worst, 0.27, label=rate)
    ax_r.set_xticks(x + 0.27, formats, rotation=40, ha="right")
    ax_r.set_ylabel("% of values (worst tensor)")
    ax_r.set_title("overflow, underflow, saturated by format")
    ax_r.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _histogram_figure(name: str, x: torch.Tensor, formats: list[str]) -> Figure | None:
    finite = x[torch.isfinite(x)].numpy()
    if finite.size == 0 or finite.min() == finite.max():
        return None
    bins = np.linspace(finite.min(), finite.max(), 81)
    fig = Figure(figsize=(10, 3.4))
    ax = fig.subplots()
    counts, edges = np.histogram(finite, bins=bins)
    ax.stairs(counts, edges, fill=True, color="#bbbbbb", label="captured")
    for fmt in formats:
        if not_applicable(tuple(x.shape), fmt) is None:
            y = fake_quantize(x, fmt)
            counts, _ = np.histogram(y[torch.isfinite(y)].numpy(), bins=bins)
            ax.stairs(counts, edges, label=fmt)
    ax.set_yscale("symlog")
    log_axis(ax.yaxis)  # plain tick labels (0, 1, 10, 100): the default ones are mathtext, drawn raw here
    ax.set_xlabel("value")
    ax.set_title(f"{name}: values under each format")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def format_section(d: ReportData, figs: Figures, formats: list[str], tensors: list[str]) -> str:
    """The section for the reference mode's `tensors` (at most MAX_TENSORS) in `formats`; "" without arrays."""
    mode = d.reference if d.reference in d.capture.modes() else next(iter(d.capture.modes()), None)
    names = [t for t in tensors if mode is not None and t in d.capture.tensors(mode)][:MAX_TENSORS]
    arrays = {t: d.capture.array(mode, t) for t in names}
    arrays = {t: torch.from_numpy(a.astype(np.float32, copy=False)) for t, a in arrays.items() if a.dtype.kind == "f"}
    if not arrays:
        return ""
    refs = {t: reference(x) for t, x in arrays.items()}
    rows = {t: {f: ({"n/a": why} if (why := not_applicable(tuple(x.shape), f)) else format_errors(x, f, refs[t]))
                for f in formats} for t, x in arrays.items()}
    parts = [figs.embed("formats_rates", _rates_figure(rows, formats), "error and overflow by format")]
    first = next(iter(arrays))
    parts.append(figs.embed(f"formats_hist_{first}", _histogram_figure(first, arrays[first], formats),
                            f"values of {first} under each format"))
    for t, per_fmt in rows.items():
        if (empty := empty_tensor(tuple(arrays[t].shape))) is not None:  # a row that says so, no metrics
            parts.append(f"<p>{esc(t)}: {esc(empty)}</p>")
            continue
        body = [[f, *(("n/a",) * 6 if "n/a" in m else (m["sqnr_db"], m["rel_l2"], m["max_abs"],
                                                       *(100 * m[r] for r in _RATES)))] for f, m in per_fmt.items()]
        parts.append(f"<details><summary>{t}</summary>" + table(
            ["format", "SQNR dB", "rel L2", "max |err|", "overflow %", "underflow %", "saturated %"], body) + "</details>")
    return section("Number formats", "".join(parts), "formats",
                   f"Mode {mode}'s tensors represented in each format (docs/formats.md): fake quantization of the "
                   "captured values, the same numbers as python -m harness formats FILE.")
