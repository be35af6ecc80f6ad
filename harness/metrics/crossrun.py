"""Comparison of the same modes across two runs (files): every metric per tensor and the first tensor, in
execution order, where the runs stop being equal or leave a tolerance (as Polygraphy and msit locate the first
bad op).

Execution order: the prefill's tensors block by block, each block's points in capture order (``capture.POINTS``;
layer 0's research names input/output/residual are its block.in/out/residual), the logits after the last block;
then the decode steps one after the other, each step block by block and point by point (``decode.*`` arrays hold
the step on axis 1); generated ids last. A tensor is "bad" where ``|a - b| > atol + rtol * |b|`` anywhere (with
the defaults 0, 0: where the two differ at all); a decode tensor is bad from its first bad step.
"""
from __future__ import annotations

import math
from typing import Callable, Mapping

import numpy as np

from ..emulation.capture import DECODE_PREFIX, DERIVED_POINTS, MAMBA2_POINTS, POINTS, RESEARCH_TENSORS
from .errors import error_metrics

__all__ = ["execution_key", "compare_runs", "bad_mask", "locate", "no_difference_text"]

_SITES = list(POINTS)   # Mamba-2's own sites before had.out, as capture.point_sort_key orders them
_SITES[_SITES.index("had.out"):_SITES.index("had.out")] = [p for p in MAMBA2_POINTS if p not in POINTS]
_ORDER = _SITES + list(DERIVED_POINTS) + ["state.ssm", "state.conv"]
_RESEARCH = {v: f"L0.{k}" for k, v in RESEARCH_TENSORS.items()}


def _point_key(name: str) -> tuple:
    """(layer, point index) of a prefill-style name; logits after every block; unknown names last."""
    name = _RESEARCH.get(name, name)
    if name == "logits":
        return (math.inf, 0)
    layer, _, point = name.partition(".")
    if layer[:1] == "L" and layer[1:].isdigit() and point in _ORDER:
        return (int(layer[1:]), _ORDER.index(point))
    return (math.inf, math.inf, name)


def locate(tensor: str) -> tuple[int | None, str]:
    """(layer, point) of a tensor name: "decode.L1.ssm.out" -> (1, "ssm.out"), "input" -> (0, "block.in"),
    "logits" / "decode.logits" / "generated_ids" -> (None, the name without "decode.")."""
    name = _RESEARCH.get(tensor, tensor)
    name = name[len(DECODE_PREFIX):] if name.startswith(DECODE_PREFIX) else name
    layer, _, point = name.partition(".")
    if layer[:1] == "L" and layer[1:].isdigit() and point:
        return int(layer[1:]), point
    return None, name


def execution_key(tensor: str, step: int | None = None) -> tuple:
    """The position of a tensor (and a decode step) in execution order (module docstring)."""
    if tensor.startswith(DECODE_PREFIX):
        return (1, step or 0, *_point_key(tensor[len(DECODE_PREFIX):]))
    if tensor == "generated_ids":
        return (2,)
    return (0, *_point_key(tensor))


def bad_mask(a: np.ndarray, b: np.ndarray, atol: float, rtol: float) -> np.ndarray:
    """Elementwise |a - b| > atol + rtol * |b| (NaN where the other is not NaN counts as bad; equal NaNs do not)."""
    a64, b64 = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        bad = np.abs(a64 - b64) > atol + rtol * np.abs(b64)
    nan_a, nan_b = np.isnan(a64), np.isnan(b64)
    return (bad & ~(nan_a | nan_b)) | (nan_a != nan_b)


def _first_bad_step(a: np.ndarray, b: np.ndarray, atol: float, rtol: float) -> int | None:
    per_step = bad_mask(a, b, atol, rtol).reshape(a.shape[0], a.shape[1], -1).any(axis=(0, 2))
    hits = np.flatnonzero(per_step)
    return int(hits[0]) if hits.size else None


def _row(a: np.ndarray, b: np.ndarray, tensor: str, atol: float, rtol: float) -> dict:
    row = error_metrics(b.astype(np.float64), a.astype(np.float64))   # B is the reference of the metrics
    row["equal"] = bool(np.array_equal(a, b, equal_nan=True))
    bad = bad_mask(a, b, atol, rtol)
    row["within_tolerance"] = not bool(bad.any())
    row["bad_elements"] = int(bad.sum())
    if tensor.startswith(DECODE_PREFIX) and a.ndim >= 2:
        step = row["first_bad_step"] = _first_bad_step(a, b, atol, rtol)
        if step is not None:   # the metrics of that step alone (the report shows them)
            row["at_first_bad_step"] = error_metrics(b[:, step].astype(np.float64), a[:, step].astype(np.float64))
    return row


def no_difference_text(entry: dict) -> str:
    """What a mode entry without a first differing tensor says: all within tolerance only when no common
    tensor was skipped (a skipped tensor was not compared and is never claimed to agree)."""
    skipped = len(entry.get("skipped", {}))
    if not skipped:
        return "none: every common tensor is within tolerance"
    compared = len(entry.get("tensors", {}))
    return (f"none among the {compared} compared tensors; {skipped} common tensor"
            f"{'s were' if skipped > 1 else ' was'} skipped (not compared)")


def compare_runs(tensors: Mapping[str, tuple[list[str], list[str]]], get_a: Callable[[str, str], np.ndarray],
                 get_b: Callable[[str, str], np.ndarray], *, atol: float = 0.0, rtol: float = 0.0,
                 comparable: Callable[[str, str], str | None] | None = None) -> dict:
    """Per mode: every metric of A against B for each tensor both have, and the first bad tensor.

    tensors: mode -> (A's tensor names, B's); get_a / get_b(mode, tensor) -> array; comparable(mode, tensor):
    None, or why the tensor is skipped (e.g. its recorded bases differ).
    Returns {"atol", "rtol", "modes": {mode: {"tensors": {tensor: row}, "first_differing": {"tensor", "step"}
    or None, "skipped": {tensor: reason}, "only_in_a": [...], "only_in_b": [...]}}}.
    """
    out: dict = {"atol": atol, "rtol": rtol, "modes": {}}
    for mode, (names_a, names_b) in tensors.items():
        common = [t for t in names_a if t in set(names_b)]
        entry: dict = {"tensors": {}, "first_differing": None, "skipped": {},
                       "only_in_a": [t for t in names_a if t not in set(names_b)],
                       "only_in_b": [t for t in names_b if t not in set(names_a)]}
        first: tuple | None = None
        for tensor in sorted(common, key=execution_key):
            why = comparable(mode, tensor) if comparable is not None else None
            if why is not None:
                entry["skipped"][tensor] = why
                continue
            a, b = get_a(mode, tensor), get_b(mode, tensor)
            if a.shape != b.shape:
                entry["skipped"][tensor] = f"shape {list(a.shape)} in A, {list(b.shape)} in B"
                continue
            row = entry["tensors"][tensor] = _row(a, b, tensor, atol, rtol)
            if row["within_tolerance"]:
                continue
            step = row.get("first_bad_step")
            key = execution_key(tensor, step)
            if first is None or key < first[0]:
                first = (key, {"tensor": tensor, "step": step})
        entry["first_differing"] = None if first is None else first[1]
        out["modes"][mode] = entry
    return out
