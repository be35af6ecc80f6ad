"""The `_stats.json` schema: every field a reader (report, compare, resume) relies on, checked before use.

A manifest of a valid pair (its sha256 matches) can still be hand-edited or crafted; the readers
index into it freely, so ``check_stats`` walks it once and raises ``StorageError`` naming the first
field whose type or value is wrong (``modes.0.tensors.output: expected an object, got a string``).
Fields the readers do not use are not checked (a newer writer may add them); nesting deeper than
``MAX_DEPTH`` is refused before anything recurses into it.

Numbers are JSON numbers (1e999 / -1e999 for infinities, null for NaN, schema 3) or, as schema 1-2
wrote them, the strings "inf", "-inf", "nan".
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from .files import StorageError

__all__ = ["check_stats", "MAX_DEPTH", "nesting_depth"]

MAX_DEPTH = 24  # the deepest legitimate path (samples.metrics.MODE.TENSOR.METRIC.ci95) is 6 levels
_NON_FINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


class _Bad(Exception):
    def __init__(self, path: str, problem: str) -> None:
        super().__init__(path, problem)
        self.path, self.problem = path, problem


def _kind(value) -> str:
    if value is None:
        return "null"
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list", dict: "an object"}
    return names.get(type(value), type(value).__name__)


def _number(value) -> float | None:
    """The float a JSON number (or a legacy non-finite string) stands for; None if it is not one."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    return _NON_FINITE.get(value) if isinstance(value, str) else None


Check = Callable[[object, str], None]


def num(*, optional: bool = True, finite: bool = False, positive: bool = False, integer: bool = False) -> Check:
    """A number (null allowed when `optional`); `finite`, `positive` (> 0), `integer` add conditions."""
    def check(value, path: str) -> None:
        if value is None and optional:
            return
        x = None if (integer and not isinstance(value, int)) else _number(value)
        what = "an integer" if integer else "a number"
        if x is None:
            raise _Bad(path, f"expected {what}, got {_kind(value)} ({value!r:.40})")
        if (finite or positive) and not math.isfinite(x):
            raise _Bad(path, f"expected a finite number, got {value!r}")
        if positive and not x > 0:
            raise _Bad(path, f"expected a number > 0, got {value!r}")
    return check


def string(optional: bool = True) -> Check:
    def check(value, path: str) -> None:
        if not (isinstance(value, str) or (value is None and optional)):
            raise _Bad(path, f"expected a string, got {_kind(value)}")
    return check


def boolean(value, path: str) -> None:
    if not isinstance(value, bool) and value is not None:
        raise _Bad(path, f"expected true or false, got {_kind(value)}")


def anything(value, path: str) -> None:
    return None


def list_of(item: Check, length: int | None = None) -> Check:
    def check(value, path: str) -> None:
        if not isinstance(value, list):
            raise _Bad(path, f"expected a list, got {_kind(value)}")
        if length is not None and len(value) != length:
            raise _Bad(path, f"expected a list of {length} values, got {len(value)}")
        for i, v in enumerate(value):
            item(v, f"{path}[{i}]")
    return check


def map_of(value_check: Check) -> Check:
    """An object with any keys, every value checked."""
    def check(value, path: str) -> None:
        if not isinstance(value, dict):
            raise _Bad(path, f"expected an object, got {_kind(value)}")
        for k, v in value.items():
            value_check(v, f"{path}.{k}")
    return check


@dataclass
class obj:
    """An object whose named fields (when present) are checked; `rest` checks every other field."""
    fields: dict[str, Check] = field(default_factory=dict)
    rest: Check = anything
    optional: bool = False  # null allowed (the readers take it for an empty object)
    required: tuple[str, ...] = ()

    def __call__(self, value, path: str) -> None:
        if value is None and self.optional:
            return
        if not isinstance(value, dict):
            raise _Bad(path, f"expected an object, got {_kind(value)}")
        missing = [k for k in self.required if k not in value]
        if missing:
            raise _Bad(path, f"expected the field {missing[0]!r}")
        for k, v in value.items():
            (self.fields.get(k) or self.rest)(v, f"{path}.{k}" if path else k)


def nullable(check: Check) -> Check:
    """null or what `check` accepts (a section the readers take as absent when null)."""
    def checked(value, path: str) -> None:
        if value is not None:
            check(value, path)
    return checked


def one_of(*checks: Check) -> Check:
    def check(value, path: str) -> None:
        problems = []
        for c in checks:
            try:
                return c(value, path)
            except _Bad as e:
                problems.append(e.problem)
        raise _Bad(path, " or ".join(dict.fromkeys(problems)))
    return check


def interval(centre: str) -> Check:
    """{centre: number, "ci95": [lo, hi]} with lo <= centre <= hi (bounds may be null: one sample)."""
    pair = list_of(num(), 2)
    shape = obj({centre: num(), "ci95": pair, "per_sample": list_of(num())})

    def check(value, path: str) -> None:
        shape(value, path)
        if "ci95" not in value or centre not in value:
            raise _Bad(path, f"expected the fields {centre!r} and 'ci95'")
        lo, hi, mid = (_number(v) for v in (*value["ci95"], value[centre]))
        if None in (lo, hi, mid) or any(math.isnan(v) for v in (lo, hi, mid)):
            return
        slack = 1e-9 * max(1.0, abs(mid))
        if not lo - slack <= mid <= hi + slack:
            raise _Bad(f"{path}.ci95", f"the interval [{lo!r}, {hi!r}] does not contain its {centre} {mid!r}")
    return check


def measured(value, path: str) -> None:
    """A number, an interval ({"mean" or "mean_diff", "ci95", ...}), or an object of such (a newer writer's
    detail, e.g. per-window values), strings and lists of numbers allowed inside it."""
    if isinstance(value, dict):
        if "ci95" in value:
            return interval("mean_diff" if "mean_diff" in value else "mean")(value, path)
        return map_of(one_of(measured, string(), list_of(num())))(value, path)
    return num()(value, path)


_STAT = num()
_RESEARCH = obj({"shape": list_of(num(integer=True)), "first_10": list_of(_STAT), "mean": _STAT, "std": _STAT,
                 "min": _STAT, "max": _STAT})
_TENSOR = obj({
    "point": string(), "basis": string(), "shape": list_of(num(integer=True)), "dtype": string(), "kind": string(),
    "first_10": list_of(_STAT), "mean": _STAT, "std": _STAT, "min": _STAT, "max": _STAT, "l2": _STAT,
    "nan_count": num(integer=True), "inf_count": num(integer=True), "quantized": boolean, "capture_dtype": string(),
    "overflow_upper": _STAT, "overflow_lower": _STAT, "scale": num(positive=True),
    "scales": obj({"per": string(), "channels": num(integer=True), "distinct": num(integer=True),
                   "min": num(positive=True), "max": num(positive=True)},
                  required=("per", "channels", "distinct", "min", "max")),
    "saturated_fraction": _STAT, "clipped_fraction": _STAT})
_CELLS, _PER_GROUP = list_of(list_of(list_of(num()))), list_of(list_of(num()))  # [g][hg][dg], [g][k]
_BY_GROUP = obj({"cells": _CELLS, "head_groups": _PER_GROUP, "dim_groups": _PER_GROUP, "all": num()},
                required=("cells", "head_groups", "dim_groups", "all"))
_Q2_GROUPS = obj({"sqnr_db": _BY_GROUP, "saturation": _BY_GROUP, "count": _CELLS,
                  "scales": map_of(one_of(num(), list_of(num()), _PER_GROUP, _CELLS))},
                 required=("sqnr_db", "saturation", "scales"))  # metrics.q2groups
_SE_SEGMENTS = map_of(map_of(obj({"fraction": num(finite=True), "error_share": num(finite=True),
                                  "count": num(integer=True)}, required=("fraction", "error_share"))))  # metrics.segments
_MODE = obj({"status": string(), "title": string(), "error": string(), "traceback": string(),
             "recipe": map_of(one_of(string(), num(), boolean, map_of(one_of(string(), num(), boolean)),
                                      map_of(map_of(one_of(string(), num(), boolean))))), "seconds": _STAT, "tensors": map_of(_TENSOR),
             "input": _RESEARCH, "output": _RESEARCH,
             "layers": map_of(obj({"q2_groups": _Q2_GROUPS, "se_segments": _SE_SEGMENTS}))})
_ROW = obj({"identical": boolean, "input_differs": boolean, "max_abs_index": list_of(num(integer=True)),
            "undefined": map_of(string())}, rest=_STAT)
_COMPARISON = obj({"reference": string(), "modes": map_of(map_of(_ROW)), "skipped": map_of(map_of(string())),
                   "identical_groups": list_of(list_of(string()))})
_E2E = map_of(map_of(measured))
_SAMPLES = obj({"count": num(integer=True), "windows": list_of(list_of(num(integer=True))), "method": string(),
                "metrics": map_of(map_of(map_of(measured))),
                "pairs": list_of(obj({"a": string(), "b": string(), "tensor": string(), "metric": string()},
                                     rest=anything)),
                })
_PAIR = interval("mean_diff")
_DIM = one_of(num(), string(), boolean, list_of(string()))  # a hybrid's dims hold its blocks' kinds, a list
_PROVENANCE = obj({"model": obj({"dims": obj(rest=_DIM, optional=True)}, optional=True),
                   "sample": obj(optional=True), "calibration": obj({"settings": obj(optional=True)}, optional=True)})
_TOP = obj({
    "schema_version": num(integer=True), "timestamp": string(), "model": string(), "pretrained_dir": string(),
    "seq_len": num(integer=True), "command": list_of(string()), "stats_only": boolean, "provenance": nullable(_PROVENANCE),
    "modes": map_of(_MODE), "aliases": map_of(string(False)), "comparison": nullable(_COMPARISON),
    "failed_modes": list_of(string()), "end_to_end": nullable(_E2E), "samples": nullable(_SAMPLES),
    "sensitivity": nullable(map_of(map_of(obj(rest=_STAT)))),
    "npz": obj({"file": string(), "sha256": string(False), "bytes": num(integer=True)}, required=("sha256",))})


def nesting_depth(obj_: object, limit: int) -> int:
    """The nesting depth of lists/objects, counted without recursion, stopping once past `limit`."""
    deepest, stack = 0, [(obj_, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
    return deepest


def check_stats(manifest: dict, where: str) -> None:
    """Raise StorageError naming the first field of `manifest` (read from `where`) that readers cannot use."""
    if nesting_depth(manifest, MAX_DEPTH) > MAX_DEPTH:
        raise StorageError(f"{where} is not a valid stats file: it nests objects or lists more than {MAX_DEPTH} "
                           f"levels deep (a stats file has at most a few)")
    try:
        _TOP(manifest, "")
        for i, pair in enumerate((manifest.get("samples") or {}).get("pairs", [])):
            _PAIR(pair, f"samples.pairs[{i}]")
    except _Bad as e:
        raise StorageError(f"{where} is not a valid stats file: field {e.path}: {e.problem}") from None
