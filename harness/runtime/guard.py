"""Clean interruption and exclusive output: signals, the output lock, the fault-injection hook.

* ``handle_signals()``: while active, SIGINT and SIGTERM raise ``Interrupted`` (a
  BaseException, so ``except Exception`` around a failing mode does not swallow it);
  ``finally`` blocks then remove temporary files and the lock, and the command line
  exits 128 + signal (130, 143) with one line saying what was kept. From then on ``sys.excepthook`` is quiet:
  multiprocessing's handle-sharing thread reports a worker killed mid-transfer through it
  (Python 3.11 multiprocessing/resource_sharer.py:133-150), a traceback that is noise once the run is interrupted.
* ``deferred_signals()``: a SIGINT/SIGTERM arriving during the two renames that commit
  an .npz + _stats.json pair is held and raised after them, so a signal never splits them.
* ``OutputLock``: ``<output>.lock`` created with O_EXCL and holding the pid. A second
  run on the same output refuses; a lock whose pid no longer exists (a run killed
  with SIGKILL) is stale and taken over, atomically (under ``flock``: one of several
  runs started together is admitted).
* ``fault_point(name)``: a test-only hook. With ``QUAMBA_HARNESS_FAULT=name:SIGNAL``
  (comma-separated pairs, SIGNAL as ``INT``, ``TERM``, ``KILL``) the process sends
  itself that signal when it reaches the named point. Points: ``before-calibration``,
  ``calibration``, ``modes``, ``write-npz``, ``write-stats``, ``between-renames``.
"""
from __future__ import annotations

import fcntl
import glob
import os
import signal
import stat
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .progress import PhaseDisplay

__all__ = ["Interrupted", "LockError", "OutputLock", "handle_signals", "deferred_signals", "fault_point",
           "quiet_handle_sharing", "Progress", "FAULT_ENV"]

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
    """What the run is doing and what is on disk, for the one line printed on interruption; with a
    `display` (``progress.PhaseDisplay``, given by the command lines unless --quiet) the long phases
    are also shown while they run: ``begin``/``advance``/``end``, or ``stage`` around a phase."""

    def __init__(self, display: "PhaseDisplay | None" = None) -> None:
        self.display = display
        self.reset()

    @classmethod
    def on_stderr(cls) -> "Progress":
        """A Progress that shows the long phases on stderr (the command lines')."""
        return cls(PhaseDisplay())

    def silenced(self, quiet: bool = True) -> "Progress":
        """This Progress, showing nothing from now on when `quiet` (--quiet)."""
        if quiet:
            self.display = None
        return self

    def begin(self, phase: str, total: int = 0, unit: str = "", estimate: float | None = None) -> None:
        """A phase starts: `total` steps of `unit` (0: unknown), `estimate` seconds if known."""
        self.phase = phase
        if self.display is not None:
            self.display.begin(phase, total, unit, estimate)

    def advance(self, n: int = 1) -> None:
        if self.display is not None:
            self.display.advance(n)

    def end(self, status: str = "done") -> None:
        if self.display is not None:
            self.display.end(status)

    def note(self, line: str) -> None:
        """A line of progress of its own (a finished unit), shown with the phases (none without a display)."""
        if self.display is not None:
            self.display.line(line)

    @contextmanager
    def stage(self, phase: str, total: int = 0, unit: str = "", estimate: float | None = None) -> Iterator[None]:
        """begin ... end around a block; a block left by an exception (or an interruption) ends it as stopped."""
        self.begin(phase, total, unit, estimate)
        try:
            yield
        except BaseException:
            self.end("stopped")
            raise
        self.end()

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


def _from_resource_sharer(tb) -> bool:
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(os.path.join("multiprocessing", "resource_sharer.py")):
            return True
        tb = tb.tb_next
    return False


def quiet_handle_sharing() -> None:
    """From now on sys.excepthook drops the reports of multiprocessing's handle-sharing thread
    (multiprocessing/resource_sharer.py calls it when a peer process dies mid-transfer): the worker pool says
    in one line which worker died (``runner.workers``). Every other report goes to the hook in place. Idempotent."""
    previous = sys.excepthook
    if getattr(previous, "_quiet_handle_sharing", False):
        return

    def hook(tp, value, tb) -> None:
        if threading.current_thread() is not threading.main_thread() and _from_resource_sharer(tb):
            return
        previous(tp, value, tb)

    hook._quiet_handle_sharing = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _quiet_excepthook(*_exc) -> None:
    """sys.excepthook after an interruption: the one line the command line prints is the message (module docstring)."""


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
        sys.excepthook = _quiet_excepthook
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


def _not_a_lock(path: Path) -> str:
    return (f"the lock file {path} is not a regular file (a FIFO, a device or a directory); remove it, or choose "
            f"another --output_file")


def _read_lock(path: Path) -> str:
    """The lock file's text; a lock that is not a regular file (a FIFO would block the read) is refused unread."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise LockError(_not_a_lock(path))
        return os.read(fd, 64).decode()
    finally:
        os.close(fd)


def _holder_alive(content: bytes, age: float) -> bool:
    """Whether the run named in a lock file's content may still hold it: its pid exists, or the file is
    still being written by a run that has just created it (no pid yet, less than 10 s old)."""
    text = content.decode("ascii", errors="replace").strip()
    if not text.isdigit():
        return age < 10.0
    return _alive(int(text))


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
    """``<output>.lock`` (O_EXCL, holding the pid) for the duration of a run.

    A lock whose pid no longer exists is stale and taken over atomically: the racer holding ``flock`` on the
    lock file checks that the path still names that very file (the same inode) and that its holder is dead,
    and only then removes it, while no other racer can judge it; the others then find the path gone or
    holding a new lock, and try again. So of several runs started together on a stale lock, exactly one is
    admitted (tests/store/test_lock_race.py).
    """

    def __init__(self, output: Path) -> None:
        output = Path(output)
        self.path = output.with_name(output.name + ".lock")
        self.held = False

    def acquire(self) -> "OutputLock":
        for _ in range(16):  # each retry follows another racer's takeover: a few suffice
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
            except FileExistsError:
                if not self._take_over_stale():
                    raise LockError(self._busy()) from None
                continue
            except OSError as e:
                raise LockError(f"cannot create the lock file {self.path}: {e.strerror}") from None
            with os.fdopen(fd, "w") as f:
                f.write(f"{os.getpid()}\n")
            self.held = True
            return self
        raise LockError(self._busy())

    def _take_over_stale(self) -> bool:
        """Remove the lock file if its run no longer exists; True when the path may be free now (removed here
        or by another racer, or replaced: try to create it again), False when a live run holds it."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return True
        except OSError as e:
            raise LockError(f"cannot read the lock file {self.path}: {e.strerror}; remove it") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise LockError(_not_a_lock(self.path))
            fcntl.flock(fd, fcntl.LOCK_EX)  # one racer at a time judges this file; released by the close
            try:
                now = os.stat(self.path)
            except FileNotFoundError:
                return True  # removed by the racer before us
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                return True  # replaced by a new lock: judge that one
            if _holder_alive(os.pread(fd, 64, 0), time.time() - st.st_mtime):
                return False
            self._remove_stale_temporaries()
            os.unlink(self.path)  # the very file judged stale, still under our flock
            return True
        except OSError as e:
            raise LockError(f"cannot take over the lock file {self.path}: {e.strerror}; remove it") from None
        finally:
            os.close(fd)

    def _remove_stale_temporaries(self) -> None:
        """The temporary .npz a killed run was streaming into (files.temp_file names, ``.<name>.*.tmp``):
        only its run, now gone, wrote there while holding this lock."""
        name = self.path.name[:-len(".lock")]
        for tmp in self.path.parent.glob(f".{glob.escape(name)}.*.tmp"):
            try:
                tmp.unlink()
            except OSError:
                pass

    def _busy(self) -> str:
        try:
            pid = _read_lock(self.path).strip() or "?"
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
