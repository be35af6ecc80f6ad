"""--ray ADDRESS|auto: each unit a Ray task (num_cpus=1; num_gpus=1 with --device cuda).

Ray is the optional extra ``[cluster]`` (ray==2.60.0), imported only here. Every node must hold the same
harness (installed, or on PYTHONPATH when its raylet starts) and read the model directory at the same path.
The driver connects before any work: a missing extra or an unreachable cluster is a RunError (exit 2)
naming the extra or the address; a host:port address is probed with a TCP connection first, as Ray itself
waits for minutes on an address where nothing listens.

A task whose worker dies (killed, out of memory, node lost) is submitted once more by the driver (Ray's own
retries are off, so the attempt number reaches the fault hook as with local workers); a second death
makes the unit a ``UnitFailed`` with Ray's reason. The reference's logits go to the object store once
(``ray.put``); the tasks of a node share that copy.

Plugins (``--plugin``): each task loads the run's plugins before its unit runs (``units.execute``; a file's
absolute path must hold the same file on every node, a module must be importable there); the plugin files'
modules are pickled by value, so a unit holding one of their objects unpickles on a node before that.
"""
from __future__ import annotations

import copy
import os
import socket
from dataclasses import dataclass

from ..plugins import FILE_MODULE_PREFIX, loaded_modules
from ..runtime.guard import FAULT_ENV
from .config import RunError
from .units import Blob, UnitFailed, timed, unit_label, worker_setup

__all__ = ["RayPool", "RayBlob", "EXTRA"]

EXTRA = "pip install -e '.[cluster]' (ray==2.60.0)"
PROBE_SECONDS = 5.0


@dataclass(frozen=True)
class RayBlob(Blob):
    ref: object  # a ray.ObjectRef

    def get(self):
        import ray

        return ray.get(self.ref)


def _task(unit, attempt: int, faults: str | None):
    """One unit in a Ray worker: (result, seconds, worker)."""
    worker_setup()
    os.environ.pop(FAULT_ENV, None)
    if faults:
        os.environ[FAULT_ENV] = faults
    return timed(unit, attempt)


def _probe(address: str) -> None:
    """A TCP connection to host:port (ray://host:port too); 'auto' and other forms are left to Ray."""
    hostport = address.split("://", 1)[-1]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=PROBE_SECONDS).close()
    except OSError as e:
        raise RunError(f"--ray {address}: cannot reach the Ray cluster there ({e.strerror or e}); start one "
                       f"(ray start --head) or give the address its head printed (host:6379), or auto") from None


class RayPool:
    """The backend interface of runner.dispatch on a Ray cluster."""

    def __init__(self, address: str, device: str = "cpu", on_done=None) -> None:
        try:
            import ray
        except ImportError:
            raise RunError(f"--ray needs Ray, an optional extra that is not installed: {EXTRA}") from None
        _probe(address)
        try:
            ray.init(address=address, log_to_driver=False, logging_level="ERROR", ignore_reinit_error=True)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise RunError(f"--ray {address}: cannot reach the Ray cluster ({e})") from None
        self._ray, self.on_done = ray, on_done
        for module in loaded_modules().values():  # a plugin file is no module a node can import by name
            if module.__name__.startswith(FILE_MODULE_PREFIX):
                ray.cloudpickle.register_pickle_by_value(module)
        self._remote = ray.remote(_task).options(num_cpus=1, num_gpus=1 if device == "cuda" else 0, max_retries=0)
        self.n = max(1, int(ray.cluster_resources().get("CPU", 1)))
        self.address = address
        self.retried: list[dict] = []
        self._tasks: dict[int, list] = {}  # handle -> [ref, unit, attempt]
        self._next = 0

    @property
    def name(self) -> str:
        return f"ray ({self.address}, {self.n} CPUs)"

    def _start(self, unit, attempt: int):
        return self._remote.remote(unit, attempt, os.environ.get(FAULT_ENV))

    def submit(self, unit) -> int:
        handle, self._next = self._next, self._next + 1
        self._tasks[handle] = [self._start(unit, 1), unit, 1]
        return handle

    def result(self, handle: int):
        ray = self._ray
        while True:
            ref, unit, attempt = self._tasks[handle]
            try:
                value, seconds, worker = ray.get(ref)
            except ray.exceptions.RayTaskError as e:  # the unit's own exception
                del self._tasks[handle]
                cause = getattr(e, "cause", None)
                raise cause if isinstance(cause, Exception) else RuntimeError(str(e)) from None
            except (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError, ray.exceptions.ObjectLostError,
                    ray.exceptions.OutOfMemoryError, ray.exceptions.RaySystemError) as e:
                reason = f"the Ray worker running unit {unit_label(unit)} died: {type(e).__name__}: " \
                         f"{str(e).splitlines()[0] if str(e) else ''}"
                self.retried.append({"unit": unit_label(unit), "attempt": attempt, "reason": reason})
                if attempt >= 2:
                    del self._tasks[handle]
                    raise UnitFailed(f"{reason}, on the retry too") from None
                self._tasks[handle] = [self._start(unit, 2), unit, 2]
                continue
            del self._tasks[handle]
            if self.on_done is not None:
                self.on_done(unit_label(unit), worker, seconds, attempt)
            return copy.deepcopy(value)  # ray.get's arrays are read-only views of the object store

    def ship(self, arrays: list) -> RayBlob:
        return RayBlob(self._ray.put(arrays))

    def close(self) -> None:
        """Cancel the tasks still running (force: their workers are killed) and disconnect."""
        for ref, _unit, _attempt in self._tasks.values():
            try:
                self._ray.cancel(ref, force=True)
            except Exception:  # finished or gone already
                pass
        self._tasks = {}
        self._ray.shutdown()
