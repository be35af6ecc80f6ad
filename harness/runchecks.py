"""Checks of a finished mode that turn a silent problem into a recorded error (NaN policy, MODES.md contract 9)."""
from __future__ import annotations

import sys

import numpy as np

__all__ = ["check_finite", "check_quantized_differ"]


def check_finite(mode: str, entry: dict, arrays: dict[str, np.ndarray]) -> None:
    """A mode whose tensors hold NaN or Inf fails (its arrays are kept): bad numbers are never a pass."""
    problems = []
    for name, arr in arrays.items():
        meta = entry["tensors"][name]
        if meta["nan_count"] or meta["inf_count"]:
            where = np.unravel_index(int(np.argmax(~np.isfinite(arr).reshape(-1))), arr.shape)
            problems.append(f"{name}: {meta['nan_count']} NaN and {meta['inf_count']} Inf of {arr.size} values, "
                            f"first at {tuple(int(i) for i in where)}")
    if problems:
        entry.update(status="error", error="non-finite values (arrays kept): " + "; ".join(problems),
                     nonfinite=problems)
        print(f"error: mode {mode} produced non-finite values (its arrays are kept): {problems[0]}"
              + (f" (and {len(problems) - 1} more tensors)" if len(problems) > 1 else ""), file=sys.stderr)


def check_quantized_differ(recipes, modes, arrays_by_mode, reference: str) -> None:
    """MODES.md contract 9: a mode that quantizes must not reproduce the float reference bit for bit."""
    ref = arrays_by_mode.get(reference)
    ref_recipe = next((r for r in recipes if r.name == reference), None)
    if ref is None or ref_recipe is None or ref_recipe.needs_calibration:
        return
    for recipe in recipes:
        arrays = arrays_by_mode.get(recipe.name)
        if recipe.name == reference or not recipe.needs_calibration or arrays is None or "resumed" in modes[recipe.name]:
            continue
        outputs = [t for t in arrays if t == "output" or t.endswith(".block.out")]
        if outputs and all(t in ref and np.array_equal(ref[t], arrays[t]) for t in outputs):
            modes[recipe.name].update(status="error", error=(
                f"the output is bit-identical to {reference} although the recipe quantizes: "
                "the quantization did not take effect"))
            arrays_by_mode.pop(recipe.name)
