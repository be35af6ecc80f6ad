"""``python -m harness eval``: every mode on every task through lm-eval, one calibration, paired with the reference.

The work is cut into units, one mode on one task, each one ``simple_evaluate`` call of lm-eval on the
``quamba-harness`` model of that mode (so a unit's numbers do not depend on which other units run beside it: a serial
run and a fanned-out one give the same results). Everything that can be checked comes first (the tasks exist, their
local data files are there, every mode runs on the model's architecture: ``EvalInputError``), then the calibrations
of every mode (each key once, from the cache when it holds it), then the units. ``NAME_eval.json`` is rewritten
atomically after every unit, so an interrupted run keeps every mode (and task) finished.
"""
from __future__ import annotations

import tempfile
import time
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Callable

from ..recipes.registry import recipe_for
from ..store.format import write_json
from .model import QuambaHarnessLM
from .results import eval_path, pair_modes, task_tables
from .session import EvalSession
from .units import (EvalConfig, EvalInputError, check_ray, evaluate_unit, generation_tasks, quiet_lm_eval,
                    run_parallel, run_ray, task_manager)

__all__ = ["EvalConfig", "EvalInputError", "run_eval", "SCHEMA"]

SCHEMA = "quamba-harness-eval/1"


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def _calibration_record(session: EvalSession) -> dict:
    """Each calibration's scalar facts (where it came from, how long it took), not its scales."""
    return {k: {n: v for n, v in c.info.items() if isinstance(v, (str, int, float, bool)) or v is None}
            for k, c in session.calibs.items()}


def _header(cfg: EvalConfig, session: EvalSession) -> dict:
    return {"schema": SCHEMA, "model": str(Path(cfg.model).resolve()), "architecture": session.architecture,
            "mamba_model_path": str(cfg.mamba_model_path) if cfg.mamba_model_path else None,
            "reference": cfg.reference, "tasks": cfg.tasks, "limit": cfg.limit, "command": cfg.argv,
            "calibration_settings": asdict(cfg.calib), "calib_file": str(cfg.calib_file),
            "max_length": cfg.max_length, "paired_bootstrap_iters": cfg.bootstrap_iters,
            "versions": {"lm_eval": _version("lm_eval"), "torch": _version("torch")},
            "calibration": _calibration_record(session)}


def _recipes(cfg: EvalConfig, session: EvalSession, emit) -> dict:
    """mode name -> its recipe on this model, the reference first when --modes leaves it out (an input error for a
    mode the model's architecture lacks, before any work)."""
    names = list(dict.fromkeys(([cfg.reference] if cfg.reference not in cfg.modes else []) + cfg.modes))
    recipes = {}
    for name in names:
        recipe = session.recipe(name)
        recipes[recipe.name] = recipe
    if cfg.reference not in cfg.modes:
        emit(f"note: the reference mode {cfg.reference} is not in --modes; it runs too (the paired differences "
             f"are against it)")
    return recipes


def _refuse_generation(tm, tasks: list[str], recipes: dict) -> None:
    """A generation task on a mode that cannot step token by token (recipe.decode_problem: an eval-only mode such as
    Quamba-SE's, whose forward ignores the inference cache) is an input error, before any work."""
    generating = generation_tasks(tm, tasks)
    for name, recipe in recipes.items():
        problem = recipe_for(recipe).decode_problem(recipe) if generating else None
        if problem is not None:
            raise EvalInputError(f"task(s) {', '.join(generating)} generate text, which mode {name} cannot: {problem}; "
                                 f"run it on loglikelihood tasks (e.g. quamba_lastword, quamba_rolling)")


class _Collect:
    """The units' results as they arrive (any order), kept in the serial order, the file rewritten after each."""

    def __init__(self, cfg: EvalConfig, doc: dict, units: list[tuple[str, str]], out: Path, emit) -> None:
        self.cfg, self.doc, self.units, self.out, self.emit = cfg, doc, units, out, emit
        self.results: dict[tuple[str, str], dict] = {}

    def write(self) -> None:
        self.doc["paired"] = pair_modes(self.doc["modes"], self.cfg.reference, iters=self.cfg.bootstrap_iters)
        write_json(self.out, self.doc)

    def done(self, unit: tuple[str, str], result: tuple[dict, float] | None, error: BaseException | None) -> None:
        mode, task = unit
        entry = self.doc["modes"][mode]
        if error is not None:
            entry.update(status="error", error=f"{type(error).__name__}: {error}")
        else:
            for name, task_result in result[0].items():  # each example's text once, from the reference's run
                texts = {str(x["doc_id"]): x.pop("text", "") for x in task_result["samples"]}
                if mode == self.cfg.reference:
                    self.doc["examples"][name] = texts
            self.results[unit], entry["seconds"][task] = result[0], result[1]
            entry["tasks"] = {k: v for u in self.units if u[0] == mode and u in self.results
                              for k, v in self.results[u].items()}
            entry["seconds"] = {u[1]: entry["seconds"][u[1]] for u in self.units if u[0] == mode and u in self.results}
        finished = all((mode, t) in self.results for t in self.cfg.tasks)
        if entry["status"] != "error":
            entry["status"] = "ok" if finished else "running"  # pending: no unit of it finished yet
        self.write()
        if error is None:
            self.emit(f"mode {mode}, task {task}: {result[1]} s")
        if entry["status"] == "error" and error is not None:
            self.emit(f"mode {mode} failed: {entry['error']}")
        elif finished:
            self.emit(f"mode {mode}: done")


def _timed(lm: QuambaHarnessLM, task: str, tm, cfg: EvalConfig) -> tuple[dict, float]:
    start = time.perf_counter()
    result = evaluate_unit(lm, task, tm, cfg)
    return result, round(time.perf_counter() - start, 3)


def _run_serial(cfg: EvalConfig, session: EvalSession, tm, collect: _Collect) -> None:
    """The units in this process, mode by mode (each mode's model built once, released after its last task)."""
    for mode in dict.fromkeys(m for m, _ in collect.units):
        try:
            lm = QuambaHarnessLM(mode=mode, session=session, batch_size=cfg.batch_size, max_length=cfg.max_length,
                                 device=cfg.device)
        except Exception as e:  # the mode fails (recorded), the others still run
            collect.done((mode, cfg.tasks[0]), None, e)
            continue
        for task in [t for m, t in collect.units if m == mode]:
            try:
                result = _timed(lm, task, tm, cfg)
            except Exception as e:  # an interruption is no Exception: it ends the run, the file keeps what finished
                collect.done((mode, task), None, e)
                continue
            collect.done((mode, task), result, None)


def run_eval(cfg: EvalConfig, emit: Callable[[str], None] = print, progress=None) -> dict:
    """Run every mode of cfg on every task; write NAME_eval.json after each unit; return its content."""
    quiet_lm_eval()
    out = eval_path(cfg.output)
    if not out.parent.is_dir():
        raise EvalInputError(f"--output {cfg.output}: directory {out.parent} does not exist")
    if cfg.ray:
        check_ray(cfg.ray)
    with tempfile.TemporaryDirectory(prefix="quamba-lmeval-tasks-") as local:
        tm = task_manager(cfg.tasks, cfg.include_path, Path(local))
        session = EvalSession(cfg.session_key(), progress=progress, emit=emit)
        recipes = _recipes(cfg, session, emit)
        _refuse_generation(tm, cfg.tasks, recipes)
        if session.models.needs_calibration(list(recipes.values())):
            session.calibration_windows()  # a calibration text too short or unreadable: an input error, exit 2
        try:  # one calibration per key, before any unit (the workers read the cache)
            session.prepare(list(recipes.values()))
        except Exception as e:  # as capture: the modes that need it fail (each says why), the float modes run
            emit(f"calibration failed: {type(e).__name__}: {e}")
        doc = {**_header(cfg, session), "modes": {n: {"status": "pending", "recipe": r.knobs(), "tasks": {},
                                                        "seconds": {}} for n, r in recipes.items()}, "paired": {},
               "examples": {}}
        units = [(mode, task) for mode in recipes for task in cfg.tasks]
        collect = _Collect(cfg, doc, units, out, emit)
        if cfg.ray:
            run_ray(cfg, units, collect.done)
        elif cfg.workers > 1:
            if cfg.cache_dir is None and session.calibs:
                emit("note: --no_cache with --workers: every worker calibrates again")
            run_parallel(cfg, units, collect.done)
        else:
            _run_serial(cfg, session, tm, collect)
        collect.write()
    emit(task_tables(doc["modes"], doc["paired"], cfg.reference))
    emit(f"\nwrote {out}")
    return doc
