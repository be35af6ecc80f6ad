"""The mode loop of a capture: every mode run, the reference first, its blocks streamed to the file.

Each block of each mode (every sample of it) is checked, compared with the reference, written
and released as soon as it finishes (``harness.runner.collect``), so memory holds one block's
activations of one mode, the weight variants the modes still to come need (``forwards.keep_only``),
the op results the modes share (``harness.runner.sharedops``, at most its ``max_bytes``, dropped when the last
mode ends) and what the studies need: per-sample rows, logits, the reference's block inputs.
"""
from __future__ import annotations

import time
import traceback
from dataclasses import dataclass

from .context import ModeLoopResult, RunContext
from .forwards import Forward, RefInputs, keep_only, per_sample_of, run_mode, stack
from ..runtime.log import error
from ..runtime.memory import release_freed
from ..architectures.mamba1.build import layer_formats
from ..architectures.registry import get_architecture
from ..emulation.capture import ISOLATED, parse_point
from .collect import Collector
from .decode import decode_mode
from .generate import GENERATED, divergence, greedy_run
from ..runtime.guard import fault_point
from ..metrics.errors import tensor_stats
from ..modes import ModeRecipe, Rotate
from ..recipes.registry import recipe_for
from ..report.text import mode_summary
from .sharedops import SharedOps
from .checks import nonfinite_problems, record_nonfinite
from .studies import end_to_end_rows, mode_sample_rows
from ..store.format import research_stats, tensor_name

__all__ = ["run_todo"]


def run_todo(ctx: RunContext, todo: list[ModeRecipe], modes: dict, collector: Collector) -> ModeLoopResult:
    """Run every mode, the reference first. Returns what the studies need: per-mode sample rows and
    end-to-end metrics, the reference's logits and block inputs, and what the modes shared."""
    cfg = ctx.cfg
    loop = ModeLoopResult()
    shared = SharedOps()
    iso_layers = [parse_point(p)[0] for p in ctx.points if p.endswith(ISOLATED)]
    wanted = tuple(sorted(set(iso_layers) | (set(cfg.layers) if cfg.sensitivity else set())))
    ordered = sorted(todo, key=lambda r: r.name != cfg.reference)
    keep_only(ctx.bank, ordered)  # what calibration prepared and no mode uses goes; only what the modes use is kept
    _submit(ctx, ordered, loop, bool(iso_layers), wanted)
    for n, recipe in enumerate(ordered):
        later = {_weight_key(r) for r in ordered[n + 1:]}
        shared.keep, shared.tag = _weight_key(recipe) in later, _weight_key(recipe)  # kept for later modes only
        with ctx.progress.stage(f"mode {recipe.name}", ctx.depth + 1, "layers"):
            _run_one(ctx, recipe, _ModeRun(modes, collector, loop, shared, bool(iso_layers), wanted))
        _submit(ctx, ordered, loop, bool(iso_layers), wanted)  # the reference's block inputs are known now
        ctx.emit(mode_summary(recipe.name, modes[recipe.name], [tensor_name(p) for p in ctx.points if "block." in p]))
        keep_only(ctx.bank, ordered if cfg.sensitivity else ordered[n + 1:])  # the studies rebuild every mode
        ctx.keep_calibrations(ordered if cfg.sensitivity else ordered[n + 1:])
        shared.release(later)
        release_freed(0)  # all the mode freed, before the next builds its head (glibc keeps up to RELEASE_MIN_FREE)
        if n == 0:
            fault_point("modes")
    loop.shared_ops = shared.summary()  # the kept results go with `shared`
    return loop


def _weight_key(recipe: ModeRecipe) -> tuple:
    """The prepared weights a mode's ops hold (the WeightBank's variant): two modes share an op only with the same."""
    return recipe.weights, recipe.rotate, recipe.prep


def _forward(ctx: RunContext, recipe: ModeRecipe, wanted: tuple[int, ...]) -> Forward:
    cfg = ctx.cfg
    return Forward(recipe, ctx.scales(recipe), ctx.samples, ctx.points, ctx.depth, cfg.basis,
                   end_to_end=cfg.end_to_end or cfg.sensitivity,
                   keep_inputs=wanted if recipe.name == cfg.reference else (), device=cfg.device,
                   head_scale=ctx.head_scale(recipe))


def _submit(ctx: RunContext, ordered: list[ModeRecipe], loop: ModeLoopResult, isolated: bool,
            wanted: tuple[int, ...]) -> None:
    """With units in other processes: submit every mode that can start (with --isolated, the other modes
    once the reference's block inputs are known), so the modes run side by side; the loop takes their
    results in its order. A mode whose Forward cannot be made (failed calibration) is left to _run_one."""
    if ctx.units is None:
        return
    for recipe in ordered:
        is_ref = recipe.name == ctx.cfg.reference
        if ctx.units.submitted(recipe.name) or (isolated and not is_ref and loop.ref_inputs is None):
            continue
        try:
            forward = _forward(ctx, recipe, wanted)
        except Exception:
            continue
        ctx.units.submit_mode(forward, None if is_ref else loop.ref_inputs)


@dataclass
class _ModeRun:
    """What every mode of the loop writes into or reads: the stats entries, the collector, the loop's result,
    the shared ops, and which layers the isolated replay and the studies need."""

    modes: dict
    collector: Collector
    loop: ModeLoopResult
    shared: SharedOps
    isolated: bool
    wanted: tuple[int, ...]


def _generate(ctx: RunContext, forward: Forward, entry: dict, collector: Collector, loop: ModeLoopResult,
              is_ref: bool, prefill: tuple | None = None) -> list[str]:
    """--generate N: the mode's greedy ids (stored, not compared as numbers) and where they leave the reference's.
    prefill: the capture run's (final residual, states), None to run the prefill again. Returns the NaN
    policy's lines for generation logits holding NaN/Inf (the mode then fails: ``checks.record_nonfinite``)."""
    with ctx.progress.stage(f"generating (mode {forward.recipe.name})", ctx.cfg.generate, "tokens"):
        ids, problems = greedy_run(forward, ctx.samples[0], ctx.cfg.generate, ctx.bank, prefill,
                                   step=ctx.progress.advance)
    collector.store_only(forward.recipe.name, {GENERATED: ids})
    entry["generate"] = {"ids": ids[0].tolist()}
    if is_ref:
        loop.ref_generated = ids
    elif loop.ref_generated is not None:
        entry["generate"].update(divergence(loop.ref_generated, ids))
    return problems


def _run_one(ctx: RunContext, recipe: ModeRecipe, run_: _ModeRun) -> None:
    cfg, samples, progress = ctx.cfg, ctx.samples, ctx.progress
    modes, collector, loop = run_.modes, run_.collector, run_.loop
    progress.phase = f"running mode {recipe.name}"
    start = time.perf_counter()
    name, is_ref = recipe.name, recipe.name == cfg.reference
    tensors: dict[str, dict] = {}
    entry = modes[name] = {"status": "ok", "title": recipe.title, "recipe": recipe.knobs(), "seconds": None,
                           "tensors": tensors}
    if (extra := recipe_for(recipe).extra_knobs(recipe)) is not None:  # a family's knobs beyond the ModeRecipe's
        entry["family_knobs"] = extra
    if recipe.has_formats:  # what each block ran (emulation.build.layer_formats)
        per_layer = get_architecture(ctx.bank.dims.architecture).extra.get("layer_formats")
        entry["layer_formats"] = layer_formats(recipe, ctx.bank.dims, ctx.depth) if per_layer is None else \
            {str(i): per_layer(recipe, ctx.bank.dims, i) for i in range(ctx.depth + 1)}
    problems: list[str] = []
    rows: dict[str, dict] = {}
    streamed = False

    def on_layer(arrays, chunk_tensors) -> None:
        nonlocal streamed
        tensors.update(chunk_tensors)
        problems.extend(nonfinite_problems(arrays, chunk_tensors))
        if cfg.samples > 1 and not is_ref and collector.has_reference and "logits" not in arrays:
            ref = {t: per_sample_of(collector.ref_get(t), len(samples)) for t in arrays if t in collector.ref_names}
            mine = {t: per_sample_of(a, len(samples)) for t, a in arrays.items()}
            rows.update(mode_sample_rows(ref, mine, name, modes, cfg.reference))
        progress.phase = f"writing mode {name}"
        collector.add(name, arrays)
        progress.phase = f"running mode {name}"
        streamed = True

    try:
        if run_.isolated and not is_ref and loop.ref_inputs is None:
            raise RuntimeError(f"--isolated needs the reference mode {cfg.reference}'s block inputs, but it failed")
        forward = _forward(ctx, recipe, run_.wanted)
        if ctx.units is None:
            run = run_mode(forward, ctx.bank, None if is_ref else loop.ref_inputs, on_layer, run_.shared,
                           step=progress.advance, keep_states=ctx.decode_ids is not None or bool(cfg.generate))
        else:  # the mode's units in other processes (runner.dispatch): one progress line per unit
            run = ctx.units.run_mode(forward, ctx.bank, None if is_ref else loop.ref_inputs, on_layer, run_.shared)
        if run.logits:
            logits = {"logits": stack(run.logits)}
            on_layer(logits, {"logits": {"point": "logits", "basis": None, **tensor_stats(logits["logits"])}})
        if ctx.decode_ids is not None:
            decode_mode(ctx, forward, on_layer, entry,
                        None if is_ref or not collector.has_reference else (collector.ref_get, collector.ref_names),
                        run.states)  # the capture prefill's states: no second prefill over the prompt
        if cfg.generate:
            problems += _generate(ctx, forward, entry, collector, loop, is_ref,
                                  None if run.states is None else (run.final_residual, run.states))
        if is_ref:
            loop.ref_logits, loop.ref_inputs = run.logits, RefInputs(recipe.rotate == Rotate.YES, run.block_inputs)
        if run.x_groups:  # Quamba2's x group diagnostics (metrics.q2groups)
            entry["layers"] = {f"L{i}": {"q2_groups": sums.stats()} for i, sums in sorted(run.x_groups.items())}
        for i, sums in sorted(run.segments.items()):  # the SE modes' segment diagnostics (metrics.segments)
            entry.setdefault("layers", {}).setdefault(f"L{i}", {})["se_segments"] = sums.stats()
        entry.update(seconds=round(time.perf_counter() - start, 3), **research_stats(tensors))
        record_nonfinite(name, entry, problems)
        if cfg.samples > 1 and not is_ref:
            loop.rows[name] = rows
        if run.logits and loop.ref_logits is not None:
            loop.e2e[name] = end_to_end_rows(loop.ref_logits, run.logits, samples)
    except Exception as e:  # a failing mode is recorded (with the blocks it finished), the others go on
        modes[name] = {"status": "error", "title": recipe.title, "recipe": recipe.knobs(),
                       "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        error(f"mode {name} failed: {type(e).__name__}: {e}")
        if streamed:  # the blocks it finished stay in the file; they take no part in the comparison
            modes[name]["tensors"] = tensors
            collector.failed(name)
            return
    if streamed:
        collector.end(name)
