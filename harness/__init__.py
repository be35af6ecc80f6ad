"""Quamba mode comparison harness: run a Mamba model under floating-point and emulated W8A8 modes,
capture layer inputs/outputs through forward hooks, and compare every mode against FP32.

    from harness import run, RunConfig, compare_modes, get_mode, list_modes
"""
from __future__ import annotations

import os

# numpy's OpenBLAS threads spin after every BLAS call and then compete with torch's
# threads (measured: the next layer forward ran up to 2x slower). The harness does
# its heavy math in torch, so numpy gets one BLAS thread unless the user says otherwise.
# This only takes effect when numpy is imported after the harness (the command lines do so).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

__version__ = "0.1.0"

from .compare import compare_modes  # noqa: E402
from .modes import get_mode, list_modes  # noqa: E402
from .pipeline import RunConfig, run  # noqa: E402

__all__ = ["__version__", "run", "RunConfig", "compare_modes", "get_mode", "list_modes"]
