"""``python -m harness eval``: every mode on every task through lm-eval, one calibration, paired with the reference.

The work is cut into units, one mode on one task, each one ``simple_evaluate`` call of lm-eval on the
``quamba-harness`` model of that mode (so a unit's numbers do not depend on which other units run beside it: a serial
run and a fanned-out one give the same results). Everything that can be checked comes first (the tasks exist, their
local data files are there, every mode runs on the model's architecture: ``EvalInputError``), then the calibrations
of every mode (each key once, from the cache when it holds it), then the units. ``NAME_eval.json`` is rewritten
atomically after every unit, so an interrupted run keeps every mode (and task) finished.
"""
from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Callable

from ..checkpoints.text import DEFAULT_CALIB_FILE
from ..runner.calibration import CalibrationSettings, default_cache_dir
from ..store.format import write_json
from .model import DEFAULT_MAX_LENGTH, QuambaHarnessLM
from .results import eval_path, pair_modes, task_tables, unit_result
from .session import EvalSession, SessionKey
from .tasks import LOCAL_TASKS, TaskError, write_local_tasks

__all__ = ["EvalConfig", "EvalInputError", "run_eval", "task_manager", "evaluate_unit", "SCHEMA"]

SCHEMA = "quamba-harness-eval/1"


class EvalInputError(ValueError):
    """Bad input of an eval run found before any work (unknown task, missing data file, ...)."""


@dataclass
class EvalConfig:
    model: Path
    modes: list[str]
    tasks: list[str]
    output: Path = Path("lmeval")
    mamba_model_path: Path | None = None
    tokenizer: Path | None = None
    reference: str = "fp32"
    include_path: list[Path] = field(default_factory=list)
    limit: float | None = None
    calib: CalibrationSettings = field(default_factory=CalibrationSettings)
    calib_file: Path = DEFAULT_CALIB_FILE
    cache_dir: Path | None = field(default_factory=default_cache_dir)
    plugins: list[str] = field(default_factory=list)
    modes_file: Path | None = None
    batch_size: int = 8
    max_length: int = DEFAULT_MAX_LENGTH
    bootstrap_iters: int = 1000   # the paired bootstrap's resamples (lm-eval's own stderr: its bootstrap_iters)
    stderr_iters: int = 1000
    device: str = "cpu"
    workers: int = 1
    argv: list[str] = field(default_factory=list)

    def session_key(self) -> SessionKey:
        return SessionKey(Path(self.model).resolve(), Path(self.mamba_model_path).resolve()
                          if self.mamba_model_path else None, Path(self.tokenizer).resolve() if self.tokenizer else None,
                          self.calib, Path(self.calib_file).resolve(), self.cache_dir, tuple(self.plugins),
                          Path(self.modes_file).resolve() if self.modes_file else None)


def task_manager(tasks: list[str], include_path: list[Path], local_dir: Path):
    """lm-eval's TaskManager over its own tasks, the local tasks (written to local_dir with absolute data paths)
    and --include_path; an unknown task or a missing local data file is an EvalInputError naming it."""
    from lm_eval.tasks import TaskManager

    missing = [p for p in include_path if not Path(p).is_dir()]
    if missing:
        raise EvalInputError(f"--include_path {', '.join(map(str, missing))}: no such directory (it must hold "
                             f"lm-eval task YAMLs)")
    try:
        write_local_tasks(local_dir, [t for t in tasks if t in LOCAL_TASKS])
    except TaskError as e:
        raise EvalInputError(str(e)) from None
    paths = [str(local_dir)] + [str(Path(p).resolve()) for p in include_path]
    tm = TaskManager(include_path=paths, include_defaults=False)  # indexing lm-eval's ~15,000 tasks takes a minute:
    if any(t not in tm.all_tasks and not tm.match_tasks([t]) for t in tasks):  # only when a task is none of ours
        tm = TaskManager(include_path=paths)
    unknown = [t for t in tasks if t not in tm.all_tasks and not tm.match_tasks([t])]
    if unknown:
        raise EvalInputError(f"unknown task(s) {', '.join(unknown)}; the local tasks are {', '.join(LOCAL_TASKS)} "
                             f"(offline), lm-eval's own are listed by `python -m lm_eval ls tasks` (their data comes "
                             f"from the Hub unless pointed at a local copy: docs/eval.md), and --include_path DIR adds "
                             f"task YAMLs")
    return tm


def evaluate_unit(lm: QuambaHarnessLM, task: str, tm, cfg: EvalConfig) -> dict:
    """One unit: lm-eval's simple_evaluate of one mode on one task (per-example values kept)."""
    from lm_eval import simple_evaluate

    evaluated = simple_evaluate(model=lm, tasks=[task], limit=cfg.limit, task_manager=tm, log_samples=True,
                                bootstrap_iters=cfg.stderr_iters, batch_size=cfg.batch_size, device=cfg.device)
    return unit_result(evaluated)


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


def run_eval(cfg: EvalConfig, emit: Callable[[str], None] = print, progress=None) -> dict:
    """Run every mode of cfg on every task; write NAME_eval.json after each unit; return its content."""
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    # lm-eval's bootstrap of a stderr forks a pool of every core (lm_eval/api/metrics.py:559-575): not from a process
    # holding torch's thread pools (and its children would inherit the run's signal handlers)
    os.environ.setdefault("DISABLE_MULTIPROC", "1")
    out = eval_path(cfg.output)
    if not out.parent.is_dir():
        raise EvalInputError(f"--output {cfg.output}: directory {out.parent} does not exist")
    with tempfile.TemporaryDirectory(prefix="quamba-lmeval-tasks-") as local:
        tm = task_manager(cfg.tasks, cfg.include_path, Path(local))
        session = EvalSession(cfg.session_key(), progress=progress, emit=emit)
        names = list(dict.fromkeys(([cfg.reference] if cfg.reference not in cfg.modes else []) + cfg.modes))
        recipes = {}
        for name in names:
            recipe = session.recipe(name)
            recipes[recipe.name] = recipe
        if cfg.reference not in cfg.modes:
            emit(f"note: the reference mode {cfg.reference} is not in --modes; it runs too (the paired differences "
                 f"are against it)")
        session.prepare(list(recipes.values()))  # one calibration per key, before any unit
        doc = {**_header(cfg, session), "modes": {}, "paired": {}}
        for name, recipe in recipes.items():
            doc["modes"][name] = _run_mode(cfg, session, recipe, tm, doc, out, emit)
            doc["calibration"] = _calibration_record(session)
        doc["paired"] = pair_modes(doc["modes"], cfg.reference, iters=cfg.bootstrap_iters)
        write_json(out, doc)
    emit(task_tables(doc["modes"], doc["paired"], cfg.reference))
    emit(f"\nwrote {out}")
    return doc


def _run_mode(cfg: EvalConfig, session: EvalSession, recipe, tm, doc: dict, out: Path, emit) -> dict:
    """One mode on every task (a unit per task), the file rewritten after each; an error is recorded, not raised."""
    entry = {"status": "running", "recipe": recipe.knobs(), "tasks": {}, "seconds": {}}
    doc["modes"][recipe.name] = entry
    try:
        lm = QuambaHarnessLM(mode=recipe.name, session=session, batch_size=cfg.batch_size,
                             max_length=cfg.max_length, device=cfg.device)
        for task in cfg.tasks:
            start = time.perf_counter()
            entry["tasks"].update(evaluate_unit(lm, task, tm, cfg))
            entry["seconds"][task] = round(time.perf_counter() - start, 3)
            write_json(out, {**doc, "paired": pair_modes(doc["modes"], cfg.reference, iters=cfg.bootstrap_iters)})
            emit(f"mode {recipe.name}, task {task}: {entry['seconds'][task]} s")
        entry["status"] = "ok"
    except Exception as e:  # a mode that fails is recorded; the others still run (an interruption is no Exception)
        entry.update(status="error", error=f"{type(e).__name__}: {e}")
    write_json(out, {**doc, "paired": pair_modes(doc["modes"], cfg.reference, iters=cfg.bootstrap_iters)})
    emit(f"mode {recipe.name}: done" if entry["status"] == "ok" else f"mode {recipe.name} failed: {entry['error']}")
    return entry
