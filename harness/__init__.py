"""Quamba mode comparison harness: run a Mamba model under floating-point and emulated W8A8 modes,
capture layer inputs/outputs through forward hooks, and compare every mode against FP32.

    from harness import run, RunConfig, compare_modes, get_mode, list_modes
"""
from __future__ import annotations

import os
import signal
import sys
import threading

# numpy's OpenBLAS threads spin after every BLAS call and then compete with torch's
# threads (measured: the next layer forward ran up to 2x slower). The harness does
# its heavy math in torch, so numpy gets one BLAS thread unless the user says otherwise.
# This only takes effect when numpy is imported after the harness (the command lines do so).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

__version__ = "0.1.0"


def _interrupted_while_starting(signum, _frame):
    """Leaves at once (os._exit): an exception raised inside torch's import can unwind through its C++
    and abort the process (exit -6, seen about once in six tries); nothing is written yet."""
    print(f"interrupted by {signal.Signals(signum).name} while starting: nothing was written", file=sys.stderr)
    sys.stderr.flush()
    os._exit(128 + signum)


# Ctrl-C during the imports below (torch takes seconds) ends `python -m harness` and the
# `quamba-harness` script quietly, with 130 and no traceback; Python's own handler is put back
# after them. A handler someone else installed (a notebook, the entry scripts) is left alone.
_quiet_start = (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
if _quiet_start:
    signal.signal(signal.SIGINT, _interrupted_while_starting)

from .compare import compare_modes  # noqa: E402
from .modes import get_mode, list_modes  # noqa: E402
from .pipeline import RunConfig, run  # noqa: E402

if _quiet_start:
    signal.signal(signal.SIGINT, signal.default_int_handler)

__all__ = ["__version__", "run", "RunConfig", "compare_modes", "get_mode", "list_modes"]
