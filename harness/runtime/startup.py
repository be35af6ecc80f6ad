"""Process set-up for the command lines; nothing here runs on `import harness`.

* ``begin()``: until the imports are done (torch takes seconds), SIGINT and SIGTERM end the
  process quietly: one line, exit 128 + signal, no traceback. While importing it leaves with
  ``os._exit``: an exception raised inside torch's import can unwind through its C++ and abort
  the process (exit -6, seen about once in six tries). Only handlers still at Python's
  defaults are replaced (a notebook's or a caller's stay).
* ``imported()``: the imports are done; the quiet handler then exits with ``sys.exit`` until
  the run installs its own (``guard.handle_signals``), or, with ``restore=True``, Python's
  defaults come back.
* In a multiprocessing child (a ``--workers`` process importing the script as ``__mp_main__``) ``begin()``
  installs nothing: the driver ends its workers with SIGTERM on a normal close, and a worker is no command
  line, so it has no "interrupted" line to print.
* numpy's OpenBLAS threads spin after every BLAS call and compete with torch's threads
  (measured: the next layer forward ran up to 2x slower); the harness does its heavy math in
  torch, so ``begin()`` gives numpy one BLAS thread unless the user set OPENBLAS_NUM_THREADS.
  It only takes effect before numpy is imported, which is why the entry points call it first.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

__all__ = ["begin", "imported"]

_DEFAULTS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
_state = {"importing": False, "installed": ()}


def _quiet_exit(signum: int, _frame: object) -> None:
    print(f"interrupted by {signal.Signals(signum).name} while starting: nothing was written", file=sys.stderr)
    if _state["importing"]:
        sys.stderr.flush()
        os._exit(128 + signum)
    sys.exit(128 + signum)


def _in_child_process() -> bool:
    """A multiprocessing child, also while it imports the parent's main module (spawn/forkserver ``prepare``)."""
    import multiprocessing

    current = multiprocessing.current_process()
    return bool(getattr(current, "_inheriting", False)) or multiprocessing.parent_process() is not None


def begin() -> None:
    """Call first in an entry point, before importing torch, numpy or the rest of the harness."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    if threading.current_thread() is not threading.main_thread() or _in_child_process():
        return
    installed = tuple(s for s, default in _DEFAULTS.items() if signal.getsignal(s) is default)
    for s in installed:
        signal.signal(s, _quiet_exit)
    _state.update(importing=True, installed=installed)


def imported(restore: bool = False) -> None:
    """The heavy imports are done; with restore, the handlers ``begin`` replaced go back to Python's defaults."""
    _state["importing"] = False
    if restore:
        for s in _state["installed"]:
            signal.signal(s, _DEFAULTS[s])
        _state["installed"] = ()
