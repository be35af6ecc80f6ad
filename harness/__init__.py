"""Quamba mode comparison harness: run a Mamba model under floating-point and emulated W8A8 modes,
capture layer inputs/outputs through forward hooks, and compare every mode against FP32.

    from harness import RunConfig, run, load_capture

    outcome = run(RunConfig(modes=["fp32", "0"], output_file="two_modes.npz"))  # the shipped tiny model
    print(outcome.stats["comparison"]["modes"]["0"]["output"]["sqnr_db"])      # mode 0's layer-0 SQNR (dB)
    capture = load_capture("two_modes.npz")                                   # the pair, read back
    print(capture.array("0", "output").shape)                                 # (1, 512, d_model)

Importing the package does nothing else: torch and the rest load on first use of a name
below, and signal handling and thread settings belong to the command lines (harness.runtime.startup).
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> the module that defines it (imported on first access, PEP 562)
_EXPORTS = {"run": "runner.pipeline", "RunConfig": "runner.config", "compare_modes": "metrics.compare",
            "get_mode": "recipes.registry", "list_modes": "recipes.registry", "load_capture": "store.reader",
            "CaptureFile": "store.reader", "CalibrationSettings": "runner.calibration"}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'harness' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
