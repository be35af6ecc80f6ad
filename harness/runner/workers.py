"""--workers N: the units of a run in N local processes, one torch thread each.

The processes come from a forkserver that has imported the harness (and torch) but run nothing: torch is
not fork-safe once its thread pools run, and a fork of that server starts in milliseconds where a spawned
process imports torch again (about 3 s of CPU, 12 s on the loaded test machine). The server lives as long
as the driver process, so a second run in the same process (the tests) starts at once. A worker reads the
fault-injection hook's setting from its unit (the server's environment is the one it started with).

The driver hands a unit to an idle worker through a pipe and waits on the pipes and the processes'
sentinels together, so it knows which unit a dead worker held: that unit is queued once more on a new
worker, and a second death makes it a ``UnitFailed`` with the reason (the signal or exit code). An
exception raised by the unit itself is its result (the mode fails as it would in a serial run), not
retried; the driver prints one line per dead worker (multiprocessing's handle-sharing thread, which would
report a worker killed mid-transfer with a traceback, is quiet: ``guard.quiet_handle_sharing``). Workers
keep SIGTERM's default action (``close`` ends them with it, no message) and ignore SIGINT (a Ctrl-C
reaches the whole process group): the driver decides, and ``close`` (in the pipeline's ``finally``)
terminates them, so an interrupted run leaves no process behind.
Each worker loads the run's plugins (``--plugin``, the entry points) before it reads its first unit.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from collections import deque
from multiprocessing.connection import wait
from pathlib import Path
from typing import Callable

import numpy as np

from ..plugins import PluginError, load_all
from ..runtime.guard import FAULT_ENV, quiet_handle_sharing
from ..runtime.log import warn
from .units import FileBlob, UnitFailed, timed, unit_label, worker_setup

__all__ = ["LocalPool"]

CLOSE_SECONDS = 10.0  # close(): how long the workers together get to exit on SIGTERM before SIGKILL


def _worker_main(conn, plugins: tuple[str, ...] = ()) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # close() ends a worker with SIGTERM: quietly, no handler
    worker_setup()
    try:  # before the first unit is unpickled: it may hold the plugins' objects (their modules' names)
        load_all(plugins)
        failed = None
    except PluginError as e:  # every unit of this worker fails with it (the driver loaded them: rare)
        failed = e
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        uid, unit, attempt, faults = msg
        if failed is not None:
            conn.send((uid, False, failed, 0.0, ""))
            continue
        os.environ.pop(FAULT_ENV, None)
        if faults:
            os.environ[FAULT_ENV] = faults
        try:
            result, seconds, name = timed(unit, attempt)
            conn.send((uid, True, result, seconds, name))
        except Exception as e:  # the unit's own failure is its result
            conn.send((uid, False, _portable(e), 0.0, ""))


def _portable(e: Exception) -> Exception:
    """The exception itself when it pickles (the mode's error names its type), else a RuntimeError saying it."""
    try:
        pickle.dumps(e)
        e.__traceback_text__ = traceback.format_exc()  # type: ignore[attr-defined]
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


class _Worker:
    def __init__(self, ctx, plugins: tuple[str, ...] = ()) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, plugins), daemon=True)
        self.proc.start()
        child.close()
        self.uid: int | None = None  # the unit it runs


def _continue(proc) -> None:
    """SIGCONT to a worker not yet known to have exited (the guard Process.terminate uses against a reused pid)."""
    if proc.exitcode is None:
        try:
            os.kill(proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def _death(proc) -> str:
    code = proc.exitcode
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class LocalPool:
    """N worker processes. submit(unit) -> handle; result(handle) runs the pool until that unit is done.

    on_done(label, worker, seconds, attempt) is told of every finished unit (progress lines); plugins: the
    run's (``harness.plugins.canonical`` specs), loaded by each worker before its first unit."""

    def __init__(self, n: int, spill: Path, on_done: Callable[[str, str, float, int], None] | None = None,
                 context: str = "forkserver", plugins: tuple[str, ...] = ()) -> None:
        self.n, self.on_done, self._spill_parent, self._spill = n, on_done, Path(spill), None
        self.plugins = tuple(plugins)
        self._ctx = multiprocessing.get_context(context)
        if context == "forkserver":
            self._ctx.set_forkserver_preload(["harness.runner.units"])
        self._workers: list[_Worker] = []
        self._queue: deque[int] = deque()
        self._units: dict[int, object] = {}
        self._attempts: dict[int, int] = {}
        self._done: dict[int, tuple[bool, object]] = {}
        self.retried: list[dict] = []
        self._next = 0
        quiet_handle_sharing()  # a worker dying mid-transfer: the one line of _died, no background traceback

    @property
    def name(self) -> str:
        return f"local ({self.n} processes)"

    def submit(self, unit) -> int:
        uid, self._next = self._next, self._next + 1
        self._units[uid], self._attempts[uid] = unit, 0
        self._queue.append(uid)
        return uid

    def result(self, handle: int):
        while handle not in self._done:
            self._step()
        ok, value = self._done.pop(handle)
        if ok:
            return value
        raise value

    def _assign(self) -> None:
        self._workers = [w for w in self._workers if w.proc.is_alive() or w.uid is not None]
        for w in self._workers:
            if w.uid is None and self._queue:
                self._send(w, self._queue.popleft())
        while self._queue and len(self._workers) < self.n:
            w = _Worker(self._ctx, self.plugins)
            self._workers.append(w)
            self._send(w, self._queue.popleft())

    def _send(self, w: _Worker, uid: int) -> None:
        self._attempts[uid] += 1
        w.uid = uid
        w.conn.send((uid, self._units[uid], self._attempts[uid], os.environ.get(FAULT_ENV)))

    def _step(self) -> None:
        self._assign()
        busy = [w for w in self._workers if w.uid is not None]
        if not busy:
            raise RuntimeError("no unit is queued or running")  # result() of a handle never submitted
        ready = set(wait([w.conn for w in busy] + [w.proc.sentinel for w in busy]))
        for w in busy:
            if w.conn in ready:
                try:
                    uid, ok, value, seconds, name = w.conn.recv()
                except (EOFError, OSError):
                    self._died(w)
                    continue
                w.uid = None
                self._done[uid] = (ok, value)
                if ok and self.on_done is not None:
                    self.on_done(unit_label(self._units[uid]), name, seconds, self._attempts[uid])
            elif w.proc.sentinel in ready:
                self._died(w)

    def _died(self, w: _Worker) -> None:
        w.proc.join(timeout=5)
        uid, w.uid = w.uid, None
        self._workers.remove(w)
        label, why = unit_label(self._units[uid]), _death(w.proc)
        reason = f"worker {w.proc.pid} {why} while running unit {label}"
        self.retried.append({"unit": label, "attempt": self._attempts[uid], "reason": reason})
        if self._attempts[uid] < 2:
            warn(f"{reason}: running it again")
            self._queue.appendleft(uid)
        else:
            first = next((r["reason"] for r in self.retried[:-1] if r["unit"] == label), "?")
            self._done[uid] = (False, UnitFailed(f"{reason}, on the retry too (the first attempt: {first})"))

    def ship(self, arrays: list[np.ndarray]) -> FileBlob:
        """Arrays every unit of a phase reads: .npy files in a temporary directory beside the output."""
        if self._spill is None:
            self._spill = Path(tempfile.mkdtemp(prefix=".quamba-harness-units-", dir=self._spill_parent))
        paths = []
        for arr in arrays:
            path = self._spill / f"{len(list(self._spill.iterdir()))}.npy"
            np.save(path, arr, allow_pickle=False)
            paths.append(str(path))
        return FileBlob(tuple(paths))

    def close(self) -> None:
        """Stop every worker (running units are abandoned), wait for them, remove the shipped files.

        SIGTERM, then SIGCONT: a stopped worker (SIGSTOP, job control) leaves SIGTERM pending until it is
        continued. Whatever has not exited by one deadline shared by all the workers is killed."""
        for w in self._workers:
            if w.proc.is_alive():
                w.proc.terminate()
                _continue(w.proc)
        deadline = time.monotonic() + CLOSE_SECONDS
        for w in self._workers:
            w.proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join()
            w.conn.close()
        self._workers, self._queue = [], deque()
        if self._spill is not None:
            shutil.rmtree(self._spill, ignore_errors=True)
            self._spill = None
