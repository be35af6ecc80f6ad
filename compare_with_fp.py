#!/usr/bin/env python3
"""Compare every mode of a capture file against FP32 (or --reference MODE); see README for the formulas.

    python compare_with_fp.py first_layer_io_all_modes.npz --json comparison.json
"""
import os
import signal
import sys

_importing = True


def _quiet_exit(signum, _frame):
    """Until the harness installs its own handlers: Ctrl-C or SIGTERM during the imports, no traceback.
    While importing, the process leaves at once: an exception raised inside torch's import can unwind
    through its C++ and abort the process (exit -6, seen about once in six tries)."""
    print(f"interrupted by {signal.Signals(signum).name} while starting: nothing was written", file=sys.stderr)
    if _importing:
        sys.stderr.flush()
        os._exit(128 + signum)
    sys.exit(128 + signum)


signal.signal(signal.SIGINT, _quiet_exit)
signal.signal(signal.SIGTERM, _quiet_exit)

from harness.cli import compare_main  # noqa: E402

_importing = False

if __name__ == "__main__":
    sys.exit(compare_main(prog="compare_with_fp.py"))
