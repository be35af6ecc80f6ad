"""The report's "Quamba2 x groups" section: per q2 mode and layer (stats ``modes.M.layers.Li.q2_groups``,
metrics.q2groups) a heat map of the int8 x's SQNR per head group x dim group beside the scale table, one pair per
SSD group, and the numbers as tables (docs/analysis.md "Quamba2 x groups"). Only a run with a q2 mode has it."""
from __future__ import annotations

import math

import numpy as np
from matplotlib.figure import Figure

from .data import ReportData
from .html import esc, section, table
from .q2text import q2_groups_of
from .sections import Figures

__all__ = ["q2_group_figure", "q2_section", "MAX_FIGURES"]

MAX_FIGURES = 8  # per mode: the layers of lowest overall SQNR; the tables cover every layer


def _grid(values, ngroups: int) -> np.ndarray:
    return np.array([[[np.nan if v is None else float(v) for v in row] for row in g] for g in values],
                    dtype=float).reshape(ngroups, -1, np.shape(values)[-1])


def _annotate(ax, data: np.ndarray, fmt) -> None:
    for (h, d), v in np.ndenumerate(data):
        ax.text(d, h, fmt(v), ha="center", va="center", fontsize=7,
                bbox={"facecolor": "white", "alpha": 0.7, "linewidth": 0, "pad": 1})  # readable on every color


def q2_group_figure(title: str, q: dict) -> Figure | None:
    """One row per SSD group: SQNR (dB) per head group x dim group, with the saturated % where codes saturate,
    and the x scale of each cell."""
    sqnr, sat = np.asarray(q["sqnr_db"]["cells"], dtype=object), q["saturation"]["cells"]
    scales = q.get("scales", {}).get("x_table")
    if sqnr.ndim != 3 or sqnr.size == 0:
        return None
    ngroups = sqnr.shape[0]
    db, frac = _grid(q["sqnr_db"]["cells"], ngroups), _grid(sat, ngroups)
    fig = Figure(figsize=(7.6, 2.6 * ngroups))
    axes = np.asarray(fig.subplots(ngroups, 2, squeeze=False))
    finite = db[np.isfinite(db)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    for g in range(ngroups):
        ax_q, ax_s = axes[g]
        shown = np.where(np.isfinite(db[g]), db[g], hi)
        im = ax_q.imshow(shown, cmap="viridis", vmin=lo, vmax=max(hi, lo + 1e-9), aspect="auto")
        fig.colorbar(im, ax=ax_q, label="SQNR dB")
        cells = np.empty(db[g].shape, dtype=object)
        for idx, v in np.ndenumerate(db[g]):
            text = "n/a" if math.isnan(v) else ("inf" if v == math.inf else f"{v:.1f}")
            cells[idx] = text + (f"\n{100 * frac[g][idx]:.2g}% sat" if frac[g][idx] > 0 else "")
        _annotate(ax_q, cells, str)
        ax_q.set_title(f"SSD group {g}: SQNR of x (dB)")
        if scales is not None:
            s = np.asarray(scales[g], dtype=float)
            im = ax_s.imshow(s, cmap="magma", aspect="auto")
            fig.colorbar(im, ax=ax_s, label="scale")
            _annotate(ax_s, s, lambda v: f"{v:.3g}")
        ax_s.set_title(f"SSD group {g}: x scale")
        for ax in (ax_q, ax_s):
            ax.grid(False)
            ax.set_xlabel("dim group")
            ax.set_ylabel("head group")
            ax.set_xticks(range(db.shape[2]))
            ax.set_yticks(range(db.shape[1]))
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _overall(q: dict) -> float:
    v = q["sqnr_db"].get("all")
    return math.inf if v is None or math.isnan(v) else v


def _at(values, index: tuple[int, ...]):
    """values[i][j]... or None where the table is missing or shorter."""
    for i in index:
        if not isinstance(values, list) or i >= len(values):
            return None
        values = values[i]
    return values


def _tables(layer: str, q: dict) -> str:
    s, count = q.get("scales", {}), q.get("count")
    pick = lambda table_, *i: _at(table_, i)  # noqa: E731
    rows = [[f"g{g} hg{h} dg{d}", v, 100 * (q["saturation"]["cells"][g][h][d] or 0.0), pick(s.get("x_table"), g, h, d),
             pick(count, g, h, d)]
            for g, per_g in enumerate(q["sqnr_db"]["cells"]) for h, per_h in enumerate(per_g)
            for d, v in enumerate(per_h)]
    scale_rows = [[f"g{g}", str(pick(s.get("x_head_group_range"), g)), str(pick(s.get("x_dim_group_range"), g)),
                   pick(s.get("B_scales"), g), pick(s.get("C_scales"), g)] for g in range(len(q["sqnr_db"]["cells"]))]
    return (f"<details><summary>{layer}: SQNR {_overall(q):.2f} dB, saturated "
            f"{100 * (q['saturation']['all'] or 0.0):.3g}%</summary>"
            + table(["cell", "SQNR dB", "saturated %", "x scale", "values"], rows)
            + table(["SSD group", "head group ends", "dim group ends (per head group)", "B scale", "C scale"],
                    scale_rows) + "</details>")


def q2_section(d: ReportData, figs: Figures) -> str:
    """The section, or "" when no mode of the run has Quamba2's x group diagnostics."""
    groups = q2_groups_of(d.stats, None, None)
    parts = []
    for mode, layers in groups.items():
        parts.append(f"<h3>{esc(mode)}</h3>")
        worst = sorted(layers, key=lambda name: (_overall(layers[name]), name))[:MAX_FIGURES]
        for name, q in layers.items():
            if name in worst:
                parts.append(figs.embed(f"q2_groups_{mode}_{name}", q2_group_figure(f"{mode} {name}", q),
                                        f"SQNR and scales of x's groups, {mode} {name}"))
            parts.append(_tables(name, q))
    if not parts:
        return ""
    return section("Quamba2 x groups", "".join(parts), "q2-groups",
                   "Quamba2 quantizes x (the conv output) with one scale per SSD group &times; head group &times; dim "
                   "group. Per cell: the SQNR of the int8 x against the float x its quantizer saw (the same mode's), "
                   "the fraction of codes at &minus;128 or 127, and the cell's scale "
                   "(docs/analysis.md, Quamba2 x groups).")
