"""Clean interruption and exclusive output: signals, the output lock, the fault-injection hook.

* ``handle_signals()``: while active, SIGINT and SIGTERM raise ``Interrupted`` (a
  BaseException, so ``except Exception`` around a failing mode does not swallow it);
  ``finally`` blocks then remove temporary files and the lock, and the command line
  exits 128 + signal (130, 143) with one line saying what was kept.
* ``deferred_signals()``: a SIGINT/SIGTERM arriving during the two renames that commit
  an .npz + _stats.json pair is held and raised after them, so a signal never splits them.
* ``OutputLock``: ``<output>.lock`` created with O_EXCL and holding the pid. A second
  run on the same output refuses; a lock whose pid no longer exists (a run killed
  with SIGKILL) is stale and taken over.
* ``fault_point(name)``: a test-only hook. With ``QUAMBA_HARNESS_FAULT=name:SIGNAL``
  (comma-separated pairs, SIGNAL as ``INT``, ``TERM``, ``KILL``) the process sends
  itself that signal when it reaches the named point. Points: ``before-calibration``,
  ``calibration``, ``modes``, ``write-npz``, ``write-stats``, ``between-renames``.
"""
from __future__ import annotations

import glob
import os
import signal
import stat
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

__all__ = ["Interrupted", "LockError", "OutputLock", "handle_signals", "deferred_signals", "fault_point",
           "Progress", "FAULT_ENV"]

FAULT_ENV = "QUAMBA_HARNESS_FAULT"
_HANDLED = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """SIGINT or SIGTERM arrived; exit_code is 128 + the signal number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.name = signal.Signals(signum).name
        self.exit_code = 128 + signum


class LockError(ValueError):
    """Another run is writing the same output."""


class Progress:
    """What the run is doing and what is on disk, for the one line printed on interruption."""

    def __init__(self) -> None:
        self.reset()

    def reset(self, output: Path | None = None) -> None:
        self.phase = "starting"
        self.output = output
        self.committed = False
        self.existed = output is not None and Path(output).exists()

    def kept(self) -> str:
        if self.output is None:
            return "nothing was written"
        if self.committed:
            return f"the new {self.output} and its stats were written completely"
        if self.existed:
            return f"{self.output} and its stats are unchanged (the previous pair); no temporary file is left"
        return "nothing was written; no temporary file is left"


_deferring = False
_pending: int | None = None


@contextmanager
def handle_signals() -> Iterator[None]:
    """SIGINT/SIGTERM -> Interrupted inside the block (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_interrupted(signum, _frame):
        global _pending
        if _deferring:
            _pending = signum
            return
        raise Interrupted(signum)

    previous = {s: signal.signal(s, raise_interrupted) for s in _HANDLED}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextmanager
def deferred_signals() -> Iterator[None]:
    """SIGINT/SIGTERM arriving inside the block raise Interrupted only when it ends.

    (Blocking with pthread_sigmask is not enough: the kernel hands a process-directed
    signal to any thread that does not block it, torch's worker threads included.)
    """
    global _deferring, _pending
    _deferring, _pending = True, None
    try:
        yield
    finally:
        _deferring = False
        signum, _pending = _pending, None
        if signum is not None:
            raise Interrupted(signum)


def fault_point(name: str) -> None:
    """Test hook: send this process the signal configured for `name` in $QUAMBA_HARNESS_FAULT."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    for item in spec.split(","):
        point, _, sig = item.partition(":")
        if point.strip() == name:
            os.kill(os.getpid(), getattr(signal, f"SIG{sig.strip().upper()}"))
            time.sleep(0.05)  # let an unblocked signal's handler run here, at the point


def _read_lock(path: Path) -> str:
    """The lock file's text; a lock that is not a regular file (a FIFO would block the read) is refused unread."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise LockError(f"the lock file {path} is not a regular file (a FIFO, a device or a directory); "
                            f"remove it, or choose another --output_file")
        return os.read(fd, 64).decode()
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    if pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class OutputLock:
    """``<output>.lock`` (O_EXCL, holding the pid) for the duration of a run."""

    def __init__(self, output: Path) -> None:
        output = Path(output)
        self.path = output.with_name(output.name + ".lock")
        self.held = False

    def acquire(self) -> "OutputLock":
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
            except FileExistsError:
                if self._owner_alive():
                    raise LockError(self._busy()) from None
                try:
                    self.path.unlink()  # stale: its run no longer exists
                    self._remove_stale_temporaries()
                except FileNotFoundError:
                    pass
                except OSError as e:
                    raise LockError(f"cannot take over the lock file {self.path}: {e.strerror}; remove it") from None
                continue
            except OSError as e:
                raise LockError(f"cannot create the lock file {self.path}: {e.strerror}") from None
            with os.fdopen(fd, "w") as f:
                f.write(f"{os.getpid()}\n")
            self.held = True
            return self
        raise LockError(self._busy())

    def _remove_stale_temporaries(self) -> None:
        """The temporary .npz a killed run was streaming into (files.temp_file names, ``.<name>.*.tmp``):
        only its run, now gone, wrote there while holding this lock."""
        name = self.path.name[:-len(".lock")]
        for tmp in self.path.parent.glob(f".{glob.escape(name)}.*.tmp"):
            try:
                tmp.unlink()
            except OSError:
                pass

    def _owner_alive(self) -> bool:
        try:
            text = _read_lock(self.path).strip()
            age = time.time() - self.path.stat().st_mtime
        except (OSError, UnicodeDecodeError):
            return False
        if not text.isdigit():
            return age < 10.0  # being written by a run that just created it
        return _alive(int(text))

    def _busy(self) -> str:
        try:
            pid = _read_lock(self.path).strip()
        except (OSError, UnicodeDecodeError):
            pid = "?"
        return (f"another run (pid {pid}) is writing {self.path.name[:-5]} (lock file {self.path}); wait for it "
                f"to finish or choose another --output_file (a lock left by a run that no longer exists is "
                f"taken over automatically)")

    def release(self) -> None:
        if self.held:
            self.held = False
            try:
                if _read_lock(self.path).strip() == str(os.getpid()):
                    self.path.unlink()
            except (OSError, ValueError):  # gone, or replaced by something that is not our lock
                pass

    def __enter__(self) -> "OutputLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
