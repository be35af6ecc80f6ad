"""Checks of a finished mode that turn a silent problem into a recorded error (NaN policy).

docs/spec/modes.md contract 9 (a quantizing mode must not reproduce the float reference bit for bit) is
checked block by block where the arrays stream past: ``harness.runner.collect``.
"""
from __future__ import annotations

import numpy as np

from ..runtime.log import error

__all__ = ["nonfinite_problems", "record_nonfinite"]


def nonfinite_problems(arrays: dict[str, np.ndarray], tensors: dict[str, dict]) -> list[str]:
    """One line per tensor holding NaN or Inf: counts and the first position."""
    problems = []
    for name, arr in arrays.items():
        meta = tensors[name]
        if meta["nan_count"] or meta["inf_count"]:
            where = np.unravel_index(int(np.argmax(~np.isfinite(arr).reshape(-1))), arr.shape)
            problems.append(f"{name}: {meta['nan_count']} NaN and {meta['inf_count']} Inf of {arr.size} values, "
                            f"first at {tuple(int(i) for i in where)}")
    return problems


def record_nonfinite(mode: str, entry: dict, problems: list[str]) -> None:
    """A mode whose tensors hold NaN or Inf fails (its arrays are kept): bad numbers are never a pass."""
    if problems:
        entry.update(status="error", error="non-finite values (arrays kept): " + "; ".join(problems),
                     nonfinite=problems)
        error(f"mode {mode} produced non-finite values (its arrays are kept): {problems[0]}"
              + (f" (and {len(problems) - 1} more tensors)" if len(problems) > 1 else ""))
