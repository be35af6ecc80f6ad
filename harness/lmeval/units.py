"""An eval run's configuration and its units: one mode on one task, run here or in worker processes.

A unit is one ``simple_evaluate`` call of lm-eval on the ``quamba-harness`` model of one mode, with one task: its
numbers depend on nothing else that runs, so the units of a run give the same results whichever process runs them
and in whatever order (``--workers N``: ``run_parallel``, N spawned processes; each opens the model once and reads
the calibrations the driver left in the calibration cache).
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..checkpoints.text import DEFAULT_CALIB_FILE
from ..runner.calibration import CalibrationSettings, default_cache_dir
from .model import DEFAULT_MAX_LENGTH, QuambaHarnessLM
from .results import unit_result
from .session import EvalSession, SessionKey
from .tasks import LOCAL_TASKS, TaskError, write_local_tasks

__all__ = ["EvalConfig", "EvalInputError", "task_manager", "evaluate_unit", "quiet_lm_eval", "run_unit",
           "run_parallel", "check_ray", "run_ray", "RAY_EXTRA"]

RAY_EXTRA = "pip install -e '.[cluster]' (ray==2.60.0)"


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
    ray: str | None = None          # a Ray cluster's address, "auto", or "local" (a cluster started for this run)
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


def generation_tasks(tm, tasks: list[str]) -> list[str]:
    """The tasks of `tasks` whose requests are generate_until (lm-eval's default output_type), read from their YAML
    (includes resolved, no !function run, no data read); a group or tag is looked into no further."""
    from lm_eval.tasks._yaml_loader import load_yaml

    out = []
    for task in tasks:
        entry = tm.task_index.get(task)
        cfg = getattr(entry, "cfg", None)
        if not isinstance(cfg, dict) or "output_type" not in cfg:
            path = getattr(entry, "yaml_path", None)
            cfg = load_yaml(path, resolve_func=False) if path is not None else None
        if isinstance(cfg, dict) and "task" in cfg and cfg.get("output_type", "generate_until") == "generate_until":
            out.append(task)
    return out


def evaluate_unit(lm: QuambaHarnessLM, task: str, tm, cfg: EvalConfig) -> dict:
    """One unit: lm-eval's simple_evaluate of one mode on one task (per-example values kept)."""
    from lm_eval import simple_evaluate

    evaluated = simple_evaluate(model=lm, tasks=[task], limit=cfg.limit, task_manager=tm, log_samples=True,
                                bootstrap_iters=cfg.stderr_iters, batch_size=cfg.batch_size, device=cfg.device)
    return unit_result(evaluated)



def quiet_lm_eval() -> None:
    """lm-eval's info lines off; no bootstrap pool: lm-eval's bootstrap of a stderr forks one process per core
    (lm_eval/api/metrics.py:559-575), not from a process holding torch's thread pools."""
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    os.environ.setdefault("DISABLE_MULTIPROC", "1")


_SESSION: dict[SessionKey, EvalSession] = {}  # per worker process: the model opened once


def run_unit(cfg: EvalConfig, mode: str, task: str) -> tuple[dict, float]:
    """One unit in this process (a worker's entry): the model opened once per process, calibrations from the cache."""
    quiet_lm_eval()
    key = cfg.session_key()
    if key not in _SESSION:
        _SESSION[key] = EvalSession(key, emit=lambda _line: None)
    with tempfile.TemporaryDirectory(prefix="quamba-lmeval-tasks-") as local:
        tm = task_manager([task], cfg.include_path, Path(local))
        lm = QuambaHarnessLM(mode=mode, session=_SESSION[key], batch_size=cfg.batch_size, max_length=cfg.max_length,
                             device=cfg.device)
        start = time.perf_counter()
        result = evaluate_unit(lm, task, tm, cfg)
        return result, round(time.perf_counter() - start, 3)


def run_parallel(cfg: EvalConfig, units: list[tuple[str, str]],
                 on_result: Callable[[tuple[str, str], dict | None, Exception | None], None]) -> None:
    """Every (mode, task) unit in cfg.workers spawned processes; on_result(unit, result, error) as each finishes,
    in the driver. An interruption cancels the units not started and ends the workers."""
    pool = ProcessPoolExecutor(max_workers=cfg.workers, mp_context=multiprocessing.get_context("spawn"))
    try:
        pending = {pool.submit(run_unit, cfg, mode, task): (mode, task) for mode, task in units}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                unit = pending.pop(future)
                error = future.exception()
                on_result(unit, None if error else future.result(), error)
    except BaseException:  # interrupted: the units not started are cancelled, the running ones' workers end now
        procs = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        raise
    pool.shutdown(wait=True)


def check_ray(address: str) -> None:
    """Before any work: Ray is installed, and a host:port (ray://host:port too) answers a TCP connection (Ray itself
    waits minutes on a dead address); an EvalInputError naming the extra or the address otherwise."""
    try:
        import ray  # noqa: F401
    except ImportError:
        raise EvalInputError(f"--ray needs Ray, an optional extra that is not installed: {RAY_EXTRA}") from None
    host, sep, port = address.split("://", 1)[-1].rpartition(":")
    if not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=5.0).close()
    except OSError as e:
        raise EvalInputError(f"--ray {address}: cannot reach the Ray cluster there ({e.strerror or e}); start one "
                             f"(ray start --head), give the address its head printed (host:6379), auto, or local") \
            from None


def run_ray(cfg: EvalConfig, units: list[tuple[str, str]],
            on_result: Callable[[tuple[str, str], tuple[dict, float] | None, BaseException | None], None]) -> None:
    """Every unit a Ray task (one CPU each) on the cluster at cfg.ray; each node must hold the same harness and read
    the model, the data and the calibration cache at the same paths (as capture's --ray, docs/scale-out.md)."""
    import ray

    ray.init(address=None if cfg.ray == "local" else cfg.ray, log_to_driver=False, logging_level="ERROR",
             ignore_reinit_error=True)
    remote = ray.remote(run_unit).options(num_cpus=1, max_retries=0)
    refs = {remote.remote(cfg, mode, task): (mode, task) for mode, task in units}
    try:
        while refs:
            (ref,), _ = ray.wait(list(refs), num_returns=1)
            unit = refs.pop(ref)
            try:
                result = ray.get(ref)
            except ray.exceptions.RayTaskError as e:  # the unit's own exception: its mode fails
                on_result(unit, None, e.as_instanceof_cause())
                continue
            except ray.exceptions.RayError as e:  # a worker or node lost
                on_result(unit, None, e)
                continue
            on_result(unit, result, None)
    finally:
        for ref in refs:
            ray.cancel(ref, force=True)
        ray.shutdown()
