"""Per-sample results -> the stats sections "end_to_end", "samples" and "sensitivity".

Input is what ``analysis.run_mode`` gives per mode: arrays per sample and logits per
sample. Output (docs/analysis.md):

    end_to_end  = {MODE: {"kl", "top1_agreement", "cross_entropy", "perplexity", "perplexity_diff"}}
                  numbers for one sample, {"mean", "ci95"} for several (the reference included); perplexity
                  over several samples {"pooled", "per_window"}, "perplexity_diff" (not for the reference)
                  the paired per-window difference mode - reference {"mean_diff", "ci95"}
    samples     = {"count": N, "windows": [[start, end], ...],
                   "metrics": {MODE: {TENSOR: {METRIC: {"mean", "ci95", "per_sample"}}}},
                   "pairs": [{"a", "b", "tensor", "metric", "mean_diff", "ci95"}]}
    sensitivity = {MODE: {LAYER: {"kl", "kl_share"}}}     LAYER a block index as a string

Per-sample metrics compare each mode's sample k with the reference's sample k; the tensor
"logits" holds the end-to-end metrics. Pairs: for every two non-reference modes a, b the
mean difference a - b of SQNR at the deepest captured block output (and of the end-to-end
cross-entropy) with a paired t interval (``intervals``).
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from ..modes import ModeRecipe
from .context import ModeLoopResult, RunContext
from .forwards import Forward, sensitivity_kl
from ..emulation.capture import point_name
from ..metrics.compare import same_basis
from ..metrics.logits import end_to_end_metrics, kl_divergence, pooled_perplexity
from ..metrics.intervals import mean_ci, paired_difference
from ..metrics.errors import error_metrics
from ..report.text import end_to_end_table
from ..store.format import tensor_name

__all__ = ["SAMPLE_METRICS", "END_TO_END_METRICS", "end_to_end_rows", "end_to_end_stats", "mode_sample_rows",
           "sample_section", "sensitivity_stats", "run_studies"]

SAMPLE_METRICS = ("sqnr_db", "rel_l2", "cosine", "mse")
END_TO_END_METRICS = ("kl", "top1_agreement", "cross_entropy", "perplexity")
LOGITS = "logits"


def end_to_end_rows(ref_logits: list[np.ndarray], logits: list[np.ndarray], samples) -> list[dict[str, float]]:
    """Per sample {"kl", "top1_agreement", "cross_entropy", "perplexity", "predicted"} of one mode against the
    reference ("predicted": the window's tokens that have a next token, the weight of its cross-entropy)."""
    return [{**end_to_end_metrics(ref_logits[k], logits[k], np.asarray(samples[k])),
             "predicted": int(np.asarray(samples[k])[..., 1:].size)} for k in range(len(samples))]


def _summary(values: list[float]) -> float | dict:
    if len(values) == 1:
        return values[0]
    s = mean_ci(values)
    return {"mean": s["mean"], "ci95": s["ci95"]}


def _perplexity(rows: list[dict]) -> float | dict:
    """One window: its perplexity. Several: {"pooled": exp(mean NLL over every predicted token of every window)
    (what papers report), "per_window": {"mean", "ci95", "min", "max"} of the windows' own perplexities}."""
    if len(rows) == 1:
        return rows[0]["perplexity"]
    per = [r["perplexity"] for r in rows]
    s = mean_ci(per)
    return {"pooled": pooled_perplexity([r["cross_entropy"] for r in rows], [r["predicted"] for r in rows]),
            "per_window": {"mean": s["mean"], "ci95": s["ci95"], "min": min(per), "max": max(per)}}


def _perplexity_diff(rows: list[dict], ref_rows: list[dict]) -> float | dict:
    """Paired: d_k = perplexity of window k under the mode minus under the reference; one window: d_0;
    several: {"mean_diff", "ci95"} (intervals.paired_difference)."""
    mine, ref = [r["perplexity"] for r in rows], [r["perplexity"] for r in ref_rows]
    if len(rows) == 1:
        return mine[0] - ref[0]
    return paired_difference(mine, ref)


def end_to_end_stats(per_sample: dict[str, list[dict[str, float]]], reference: str | None = None) -> dict:
    """MODE -> KL, top-1 agreement, cross-entropy (a number, or mean with CI), perplexity (``_perplexity``)
    and, for every mode but `reference`, "perplexity_diff" (``_perplexity_diff``)."""
    out = {}
    for mode, rows in per_sample.items():
        out[mode] = {m: _summary([row[m] for row in rows]) for m in END_TO_END_METRICS if m != "perplexity"}
        out[mode]["perplexity"] = _perplexity(rows)
        if reference in per_sample and mode != reference:
            out[mode]["perplexity_diff"] = _perplexity_diff(rows, per_sample[reference])
    return out


def mode_sample_rows(ref: dict[str, list[np.ndarray]], mine: dict[str, list[np.ndarray]], mode: str,
                     modes: dict[str, dict], reference: str) -> dict[str, dict]:
    """TENSOR -> METRIC -> {"mean", "ci95", "per_sample"} of one mode against the reference, sample by sample
    (tensors of another basis or shape are left out, as in the comparison)."""
    if mode == reference:
        return {}
    comparable = same_basis(lambda m, t: modes[m].get("tensors", {}).get(t, {}).get("basis"), reference)
    rows = {}
    for tensor, values in mine.items():
        if tensor not in ref or comparable(mode, tensor) is not None or values[0].shape != ref[tensor][0].shape:
            continue
        per = [error_metrics(r, v) for r, v in zip(ref[tensor], values)]
        rows[tensor] = {m: mean_ci([p[m] for p in per]) for m in SAMPLE_METRICS}
    return rows


def sample_section(rows: dict[str, dict], e2e: dict[str, list[dict]] | None, pair_tensor: str,
                   windows: list[list[int]]) -> dict:
    """The "samples" section from every mode's rows (``mode_sample_rows``) and end-to-end rows."""
    metrics = {mode: dict(r) for mode, r in rows.items() if r}
    for mode, per in (e2e or {}).items():
        metrics.setdefault(mode, {})[LOGITS] = {m: mean_ci([r[m] for r in per]) for m in END_TO_END_METRICS}
    others = [m for m in rows if rows[m]]
    pairs = []
    for a, b in itertools.combinations(others, 2):
        for tensor, metric in ((pair_tensor, "sqnr_db"), (LOGITS, "cross_entropy")):
            va = metrics.get(a, {}).get(tensor, {}).get(metric)
            vb = metrics.get(b, {}).get(tensor, {}).get(metric)
            if va is None or vb is None:
                continue
            pairs.append({"a": a, "b": b, "tensor": tensor, "metric": metric,
                          **paired_difference(va["per_sample"], vb["per_sample"])})
    return {"count": len(windows), "windows": windows, "method": "Student t on per-sample values (95 %)",
            "metrics": metrics, "pairs": pairs}


def sensitivity_stats(kl_by_layer: dict[int, list[float]], full_kl: list[float]) -> dict[str, dict]:
    """LAYER -> {"kl": mean over samples, "kl_share": that / the mode's own end-to-end mean KL}."""
    total = float(np.mean(full_kl))
    out = {}
    for layer, values in sorted(kl_by_layer.items()):
        kl = float(np.mean(values))
        out[str(layer)] = {"kl": kl, "kl_share": kl / total if total > 0 else (0.0 if kl == 0 else math.inf)}
    return out


def _remote_sensitivity(ctx: RunContext, by_name: dict[str, ModeRecipe], ok: list[str],
                        loop: ModeLoopResult) -> dict[str, dict[int, list[float]]]:
    """The sensitivity study as mode x layer units (runner.dispatch), every mode's at once."""
    cfg = ctx.cfg
    ctx.progress.phase = "sensitivity (units in other processes)"
    fwd = {m: Forward(by_name[m], ctx.scales(by_name[m]), ctx.samples, ctx.points, ctx.depth, device=cfg.device,
                      head_scale=ctx.head_scale(by_name[m]))
           for m in [cfg.reference] + [m for m in ok if m != cfg.reference]}
    jobs = {m: (f, fwd[cfg.reference]) for m, f in fwd.items() if m != cfg.reference}
    return ctx.units.sensitivity(jobs, loop.ref_inputs, loop.ref_logits, cfg.layers)


def run_studies(ctx: RunContext, recipes: list[ModeRecipe], modes: dict[str, dict], loop: ModeLoopResult) -> dict:
    """The stats sections end_to_end, samples and sensitivity of the modes that ran (loop: the mode loop's result)."""
    cfg, emit = ctx.cfg, ctx.emit
    ok = [m for m in modes if modes[m].get("status") == "ok" and not modes[m].get("resumed")]
    if cfg.reference not in ok:
        return {}
    out: dict = {}
    e2e = {m: loop.e2e[m] for m in ok if m in loop.e2e}
    if e2e and cfg.end_to_end:
        out["end_to_end"] = end_to_end_stats(e2e, cfg.reference)
        emit(end_to_end_table(out["end_to_end"], cfg.reference))
    if cfg.samples > 1:
        out["samples"] = sample_section({m: loop.rows.get(m, {}) for m in ok}, e2e if cfg.end_to_end else None,
                                        tensor_name(point_name(max(cfg.layers), "block.out")),
                                        [[k * cfg.seq_len, (k + 1) * cfg.seq_len] for k in range(cfg.samples)])
    if cfg.sensitivity:
        by_name = {r.name: r for r in recipes}
        ref = by_name[cfg.reference]
        out["sensitivity"] = {}
        remote = _remote_sensitivity(ctx, by_name, ok, loop) if ctx.units is not None else None
        for mode in ok:
            if mode == cfg.reference:
                continue
            if remote is not None:  # the mode x layer units ran in other processes
                out["sensitivity"][mode] = sensitivity_stats(remote[mode], [r["kl"] for r in e2e[mode]])
                continue
            mode_fwd, ref_fwd = (Forward(r, ctx.scales(r), ctx.samples, ctx.points, ctx.depth, device=cfg.device,
                                         head_scale=ctx.head_scale(r))
                                 for r in (by_name[mode], ref))
            with ctx.progress.stage(f"sensitivity of mode {mode}", len(cfg.layers) * len(ctx.samples), "forwards"):
                kl = sensitivity_kl(mode_fwd, ref_fwd, ctx.bank, loop.ref_inputs, loop.ref_logits, cfg.layers,
                                    kl_divergence, step=ctx.progress.advance)
            out["sensitivity"][mode] = sensitivity_stats(kl, [r["kl"] for r in e2e[mode]])
        if ctx.units is not None and ctx.units.failed_units:
            out["failed_units"] = list(ctx.units.failed_units)
    return out
