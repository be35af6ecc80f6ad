"""The report's sections: each turns ReportData into HTML (and figures), and is empty when the data is absent."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from matplotlib.figure import Figure

from .figures import (
    end_to_end_figure,
    layer_sqnr_figure,
    overflow_per_layer_figure,
    render,
    taps_figure,
    tensor_figure,
)
from .data import ReportData, as_float, block_out_name, layer_and_site
from .groups import array_key
from .text import IDENTICAL_NOTE
from .html import comparison_table, esc, facts, fmt_value, image, section, table

__all__ = ["Figures", "focus_layers", "header_section", "comparison_section", "layers_section", "end_to_end_section",
           "taps_section", "tensor_section", "select_tensors", "AUTO_ALL_LIMIT"]

# With up to this many tensors every one gets its figure; beyond it (e.g. 24 layers x all taps) every
# tensor of the first captured layer and the block outputs of the focus layers do (--tensors chooses others).
AUTO_ALL_LIMIT = 40
FOCUS_LAYERS = 6


@dataclass
class Figures:
    """Collects the figures of one report: PNG for the page and, with --figures, PNG + SVG files."""

    sink: Callable[[str, Figure], None] | None = None
    names: list[str] = field(default_factory=list)

    def embed(self, name: str, fig: Figure | None, alt: str, caption: str = "") -> str:
        if fig is None:
            return ""
        slug = re.sub(r"[^A-Za-z0-9.+-]+", "_", name).strip("_")
        self.names.append(slug)
        if self.sink is not None:
            self.sink(slug, fig)
        return image(render(fig, "png"), alt, caption, anchor=f"fig-{slug}")


def header_section(d: ReportData) -> str:
    s, prov = d.stats, d.stats.get("provenance", {}) or {}
    model, sample = prov.get("model", {}) or {}, prov.get("sample", {}) or {}
    meta = {}
    for key in ("model", "timestamp", "seq_len", "pretrained_dir"):
        if key in d.capture.npz.files:
            meta[key] = str(d.capture.npz[key])
    dims = model.get("dims") or {}
    calib = prov.get("calibration") or {}
    parts = [facts([
        ("model", model.get("path") or s.get("model") or meta.get("model")),
        ("tokens", sample.get("tokens") or s.get("seq_len") or meta.get("seq_len")), ("reference", d.reference),
        ("timestamp", s.get("timestamp") or meta.get("timestamp")),
    ]), "<details><summary>provenance</summary>" + facts([
        ("file", str(d.path.resolve())), ("schema version", s.get("schema_version", 0 if d.research_file else None)),
        ("model format / dtype", " / ".join(str(x) for x in (model.get("format"), model.get("stored_dtype")) if x)),
        ("dims", ", ".join(f"{k} {v}" for k, v in dims.items())), ("model sha256", model.get("hash")),
        ("sample", sample.get("text_file")), ("token ids sha256", sample.get("token_ids_sha256")),
        ("layers / taps", f"{prov.get('layers')} / {prov.get('taps')}" if prov.get("layers") is not None else None),
        ("calibration", ", ".join(f"{k} {v}" for k, v in (calib.get("settings") or {}).items())
         + (f" ({calib.get('source')})" if calib.get("source") else "") if calib else None),
        ("command", " ".join(map(str, s.get("command") or [])) or None),
        ("versions", ", ".join(f"{k} {prov[k]}" for k in ("harness_version", "torch", "transformers", "numpy", "python")
                               if prov.get(k))),
        ("platform / device", " / ".join(str(prov[k]) for k in ("platform", "device") if prov.get(k))),
    ]) + "</details>"]
    if d.research_file:
        parts.append('<p class="note">A research-tool file: arrays only, no manifest, so no recipes, scales or '
                     'provenance beyond its metadata keys.</p>')
    entries = {m: d.mode_entry(m) for m in dict.fromkeys(list(d.stats.get("modes", {})) + d.modes)}
    knobs = list(dict.fromkeys(k for e in entries.values() for k in (e.get("recipe") or {})))
    rows = [[m, e.get("title", ""), e.get("status", "ok"), *[(e.get("recipe") or {}).get(k, "") for k in knobs]]
            for m, e in entries.items()]
    parts.append("<h3>Modes and their recipes</h3>" + table(["mode", "name", "status", *knobs], rows, left=3))
    if d.failed:
        parts.append("<h3>Failed modes</h3>" + table(["mode", "why"], [[m, w] for m, w in d.failed.items()], left=2))
    return section("Run", "".join(parts), "run")


def comparison_section(d: ReportData) -> str:
    c = d.comparison
    if not c or not c.get("modes"):
        return section("Comparison", f'<p class="note">No comparison: the reference mode {esc(d.reference)} has no '
                       'arrays or comparison in this file.</p>', "comparison")
    titles = {m: d.mode_entry(m).get("title", "") for m in d.modes}
    by_tensor: dict[str, dict[str, dict]] = {}
    for mode, rows in c["modes"].items():
        for tensor, row in rows.items():
            by_tensor.setdefault(tensor, {})[mode] = row
    parts = []
    groups = c.get("identical_groups") or []
    parts.append("<p><b>Bit-identical modes</b> (every shared tensor equal bit for bit): "
                 + (esc("; ".join(" = ".join(g) for g in groups)) if groups else "none")
                 + (f' <span class="note">({esc(IDENTICAL_NOTE)})</span>' if groups else "") + "</p>")
    unfolded = _open_tensors(d, list(by_tensor))
    for tensor, rows in by_tensor.items():
        body = comparison_table(tensor, rows, d.reference, titles)
        summary = f"{esc(tensor)}"
        parts.append(f"<details{' open' if tensor in unfolded else ''}><summary>{summary}</summary>{body}</details>")
    skipped = [[m, t, r] for m, by in (c.get("skipped") or {}).items() for t, r in by.items()]
    if skipped:
        parts.append("<h3>Not compared</h3>" + table(["mode", "tensor", "reason"], skipped, left=3))
    note = (f"Every metric of every mode against {esc(d.reference)} (d = mode &minus; reference); the worst value "
            "of each column is highlighted. The last block output and the logits are open; click a tensor's name "
            "for the others.")
    return section("Comparison", "".join(parts), "comparison", note)


def layers_section(d: ReportData, figs: Figures, colors: dict) -> str:
    layers, acc, iso = d.layer_sqnr()
    fig = layer_sqnr_figure(layers, acc, iso, colors)
    if fig is None:
        return ""
    parts = [figs.embed("layers_sqnr", fig, "SQNR per layer",
                        "Solid: accumulated (the mode's own input, errors of earlier layers included); dashed: "
                        "isolated (the layer alone on the reference's input), where the file has it.")]
    parts += _kind_tables(d)
    for mode, rows in d.sensitivity().items():
        cols = [("layer", "layer"), ("isolated_sqnr_db", "isolated SQNR dB"), ("accumulated_sqnr_db", "accumulated SQNR dB"),
                ("sqnr_drop_db", "SQNR lost at this layer dB"), ("kl", "KL with only this layer in the mode"),
                ("kl_share", "share of end-to-end KL")]
        cols = [c for c in cols if any(r[c[0]] is not None for r in rows)]
        parts.append(f"<h3>Sensitivity ranking: mode {esc(mode)} ({esc(d.sensitivity_order(rows))})</h3>"
                     + table([h for _, h in cols], [[r[k] for k, _ in cols] for r in rows]))
    return section("Error per layer", "".join(parts), "layers")


def _kind_tables(d: ReportData) -> list[str]:
    """A hybrid's per-layer error grouped by layer kind (SSM, attention, MLP), per mode; the kind whose worst
    isolated SQNR is lowest is the one that breaks first."""
    out = []
    for mode, kinds in d.kind_sqnr().items():
        if not kinds:
            continue
        scored = {k: r["isolated_min_db"] for k, r in kinds.items() if r["isolated_min_db"] is not None}
        first = min(scored, key=scored.get) if scored else None
        rows = [[k + (" (breaks first)" if k == first else ""), r["blocks"], r["isolated_min_db"],
                 r["isolated_min_layer"], r["isolated_mean_db"], r["accumulated_min_db"]] for k, r in kinds.items()]
        out.append(f"<h3>Error by layer kind: mode {esc(mode)}</h3>" + table(
            ["kind", "blocks", "worst isolated SQNR dB", "at block", "mean isolated SQNR dB",
             "worst accumulated SQNR dB"], rows))
    return out


def end_to_end_section(d: ReportData, figs: Figures, colors: dict) -> str:
    e2e = d.end_to_end()
    if not e2e:
        return ""
    cols = [k for k in ("kl", "top1_agreement", "cross_entropy", "perplexity", "perplexity_diff")
            if any(k in e for e in e2e.values())]

    def cell(v):
        if isinstance(v, dict) and "pooled" in v:  # several windows: exp(mean NLL of all tokens), windows' range
            w = v.get("per_window") if isinstance(v.get("per_window"), dict) else {}
            return (f"{fmt_value(as_float(v.get('pooled')))} (windows {fmt_value(as_float(w.get('min')))} to "
                    f"{fmt_value(as_float(w.get('max')))})")
        if isinstance(v, dict):
            ci = v.get("ci95") if isinstance(v.get("ci95"), list) and len(v.get("ci95")) == 2 else [None, None]
            m = v.get("mean", v.get("mean_diff"))
            return f"{fmt_value(as_float(m))} [{fmt_value(as_float(ci[0]))}, {fmt_value(as_float(ci[1]))}]"
        return as_float(v)
    rows = [[m, *[cell(e2e[m].get(k)) for k in cols]] for m in e2e]
    fig = end_to_end_figure(e2e, {m: colors.get(m, "#777777") for m in e2e})
    heads = {"perplexity_diff": f"perplexity − {d.reference} (paired)"}
    body = figs.embed("end_to_end", fig, "end-to-end metrics per mode") + table(["mode", *[heads.get(c, c) for c in cols]],
                                                                               rows)
    return section("End to end", body, "end-to-end",
                   "Next-token distributions of the whole model against the reference: mean KL(reference &#8214; mode), "
                   "top-1 agreement, cross-entropy and perplexity of the sample's actual next tokens "
                   "(values with [95 % interval] when several samples ran). Perplexity over several windows is "
                   "exp(mean NLL over every predicted token), with the windows' range; the mode's difference to "
                   "the reference is paired (window by window), so text difficulty cancels.")


def focus_layers(d: ReportData) -> list[int]:
    """Layers that get detailed figures: all of up to 8; else the first, the last and the 6 with the
    lowest SQNR of any mode (the per-layer charts and the tables cover every layer)."""
    layers, acc, _ = d.layer_sqnr()
    every = d.layers()
    if len(every) <= FOCUS_LAYERS + 2:
        return every

    def worst(k: int) -> float:
        vals = [v[k] for v in acc.values() if v[k] is not None]
        return min(vals) if vals else float("inf")
    ranked = sorted(range(len(layers)), key=lambda k: (worst(k), layers[k]))[:FOCUS_LAYERS]
    return sorted({every[0], every[-1], *[layers[k] for k in ranked]})


def _scale_cell(entry: dict):
    """A tap's scale, or for a scale per channel (Quamba2's multi-scale taps) their count and range."""
    many = entry.get("scales")
    if many:
        return f"{many['distinct']} scales over {many['channels']} channels, {many['min']:.4g} to {many['max']:.4g}"
    return entry.get("scale")


def taps_section(d: ReportData, figs: Figures, colors: dict) -> str:
    taps = d.taps_by_layer()
    parts = []
    layers = list(taps)
    sat = {m: [max((g.get(m, {}).get("saturated_fraction") or 0.0 for g in taps[i].values()), default=None)
               for i in layers] for m in d.modes if any(m in g for i in layers for g in taps[i].values())}
    clip = {m: [max((g.get(m, {}).get("clipped_fraction") or 0.0 for g in taps[i].values()), default=None)
                for i in layers] for m in sat}
    parts.append(figs.embed("overflow_per_layer", overflow_per_layer_figure(layers, sat, clip, colors),
                            "saturation and overflow per layer"))
    focus = focus_layers(d)
    for layer, by_tap in taps.items():
        if layer in focus:
            fig = taps_figure(f"layer {layer}: int8 tensors per tap", by_tap, colors)
            parts.append(figs.embed(f"taps_L{layer}", fig, f"saturation, overflow and scales of layer {layer}"))
        rows = [[tap, *[_scale_cell(by_mode.get(m, {})) for m in d.modes]] for tap, by_mode in by_tap.items()]
        parts.append(f"<details><summary>layer {layer}: scales</summary>"
                     + table(["tap", *[f"scale {m}" for m in d.modes]], rows) + "</details>")
    if not "".join(parts):
        return ""
    return section("Saturation, overflow and scales", "".join(parts), "taps",
                   "Per int8 tensor and mode: the fraction of codes at the ends of the grid (&minus;128, 127), the "
                   "fraction of values that were beyond &plusmn;127.5&middot;scale before saturation, and the scale.")


def select_tensors(d: ReportData, wanted: list[str] | None) -> list[str]:
    names = d.tensors()
    if wanted and wanted != ["auto"]:
        return names if wanted == ["all"] else [t for t in names if t in wanted]
    if len(names) <= AUTO_ALL_LIMIT:
        return names
    first, focus = min(d.layers(), default=None), focus_layers(d)
    return [t for t in names if layer_and_site(t)[0] == first
            or (layer_and_site(t)[0] in focus and layer_and_site(t)[1] in ("block.out", "block.isolated"))]


def _open_tensors(d: ReportData, tensors: list[str]) -> set[str]:
    """Tensors whose figures show unfolded: the last layer's block output and the logits."""
    last = max(d.layers(), default=None)
    return {t for t in tensors if t == "logits" or (last is not None and t == block_out_name(last))}


def tensor_section(d: ReportData, figs: Figures, colors: dict, tensors: list[str]) -> str:
    parts, same, repeated, seen = [], [], [], {}
    unfolded = _open_tensors(d, tensors)
    for tensor in tensors:
        ref = d.array(d.reference, tensor)
        if ref is None:
            continue
        values = {m: d.array(m, tensor) for m in d.modes if m != d.reference}
        values = {m: v for m, v in values.items() if v is not None}
        signature = (array_key(ref), *[(m, array_key(v)) for m, v in values.items()])
        if signature in seen:                       # e.g. layer 0's isolated output is its output
            repeated.append(f"{tensor} (= {seen[signature]})")
            continue
        seen[signature] = tensor
        identical = [m for m, v in values.items() if np.array_equal(v, ref)]
        grids = {m: g for m in values if (g := d.grid(m, tensor))}
        site = layer_and_site(tensor)[1]
        axes = ("channel", "state") if site == "ssm.state" else ("token", "channel")
        fig = tensor_figure(f"{tensor} against {d.reference}", ref, values, colors, grids, axes)
        if fig is None:
            same.append(tensor)
            continue
        caption = (f"{esc(tensor)} {esc(list(ref.shape))}." + (f" Bit-identical to the reference: {esc(', '.join(identical))}."
                                                               if identical else ""))
        parts.append(f"<details{' open' if tensor in unfolded else ''}><summary>{esc(tensor)}</summary>"
                     + figs.embed(f"tensor_{tensor}", fig, f"figures of {tensor}", caption) + "</details>")
    if same:
        parts.append(f'<p class="note">Every mode equals the reference bit for bit in: {esc(", ".join(same))}.</p>')
    if repeated:
        parts.append(f'<p class="note">The same arrays in every mode as a tensor above (no second figure): '
                     f'{esc(", ".join(repeated))}.</p>')
    chosen = set(tensors)
    left_out = [t for t in d.tensors() if t not in chosen]
    if left_out:
        parts.append(f'<p class="note">{len(left_out)} tensors have no figures here (draw them with --tensors): '
                     f'{esc(", ".join(left_out))}.</p>')
    if not parts:
        return ""
    return section("Per tensor", "".join(parts), "tensors",
                   "Per tensor, every mode that differs from the reference (modes with equal arrays drawn once, "
                   "named together): histogram of the error (log count); values with each int8 mode's clip lines "
                   "at &plusmn;127.5&middot;scale; mean |error| against the reference's magnitude; RMS error per "
                   "token (line) and per channel (heatmap). The last block output and the logits are open; "
                   "click a tensor's name for the others.")
