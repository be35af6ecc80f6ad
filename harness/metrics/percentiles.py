"""p50, p90, p99 of |d| exactly as ``np.percentile`` (method "linear") gives them, without its copy.

The order statistics around each percentile are selected on the int64 view of the non-negative
float64 values (their bit patterns sort as the floats do). A sorted sample brackets each run of
adjacent ranks by two sample values lo <= hi; if below = #(keys < lo) <= rank and
rank < below + #(lo <= keys <= hi), the answer is the (rank - below)-th smallest of the few keys in
[lo, hi] (sorted, exactly those occupy positions below .. below + count - 1). When a bracket misses
(or the array is small) one partition of the whole array decides. ``Brackets`` does the same over an
array seen in chunks (the end-to-end logits: 25.7M values, never held as one float64 copy).
"""
from __future__ import annotations

import math

import numpy as np

__all__ = ["abs_percentiles", "Brackets", "percentiles_from", "ranks_of", "sample_step", "SAMPLED_FROM"]

_PERCENTS = np.array([50.0, 90.0, 99.0])
SAMPLED_FROM = 1 << 14  # arrays from this size on are bracketed from a sample


def _ranks(n: int):
    """numpy 2.4's ``_quantile`` positions: the virtual index of each percentile, its two neighbours."""
    virtual = (n - 1) * np.true_divide(_PERCENTS, 100)
    prev = np.floor(virtual)
    nxt = prev + 1
    above = virtual >= n - 1
    prev[above], nxt[above] = -1, -1
    prev_i, next_i = prev.astype(np.intp), nxt.astype(np.intp)
    return virtual, prev_i, next_i, [int(r) for r in np.unique(np.concatenate((prev_i, next_i)) % n)]


def _interpolate(lo: np.ndarray, hi: np.ndarray, virtual: np.ndarray, prev_i: np.ndarray) -> tuple[float, float, float]:
    """numpy 2.4's ``_lerp``, operation for operation."""
    gamma = np.asanyarray(virtual - prev_i, dtype=virtual.dtype)
    diff = hi - lo
    out = np.add(lo, diff * gamma)
    np.subtract(hi, diff * (1 - gamma), out=out, where=gamma >= 0.5, casting="unsafe", dtype=type(out.dtype))
    return float(out[0]), float(out[1]), float(out[2])


def sample_step(n: int) -> int:
    """Every step-th key is sampled; coprime to 2, 3, 5, 7: the sample walks across the channels of (..., C)."""
    step = n >> 11
    while math.gcd(step, 210) != 1:
        step += 1
    return step


def _groups(ranks: list[int]) -> list[list[int]]:
    groups = [[ranks[0]]]
    for r in ranks[1:]:
        if r == groups[-1][-1] + 1:
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups


def _in_bracket(keys: np.ndarray, lo, hi) -> tuple[int, np.ndarray]:
    """(#keys < lo, the keys in [lo, hi]); an open end (None) bounds nothing."""
    ge, le = (None if lo is None else keys >= lo), (None if hi is None else keys <= hi)
    below = 0 if ge is None else keys.size - int(np.count_nonzero(ge))
    mask = ge if le is None else (le if ge is None else np.logical_and(ge, le, out=ge))
    return below, (keys.copy() if mask is None else keys[mask])


def _pick(group: list[int], below: int, inside: np.ndarray) -> dict[int, int] | None:
    if not (below <= group[0] and group[-1] < below + inside.size):
        return None
    inside.partition([r - below for r in group])
    return {r: int(inside[r - below]) for r in group}


class Brackets:
    """The order statistics of `ranks` among n keys seen in chunks: ``sample`` every chunk in order
    (pass 1), then ``count`` every chunk (pass 2), then ``select``. None from select: a bracket missed."""

    def __init__(self, n: int, ranks: list[int]):
        self.n, self.ranks, self.step = n, ranks, sample_step(n)
        self._samples: list[np.ndarray] = []
        self._bounds: list[tuple[list[int], object, object]] = []
        self._below: list[int] = []
        self._inside: list[list[np.ndarray]] = []

    def sample(self, start: int, keys: np.ndarray) -> None:
        """keys: the chunk starting at flat position `start`; keeps those at multiples of step."""
        self._samples.append(keys[(-start) % self.step::self.step].copy())

    def _prepare(self) -> None:
        sample = np.sort(np.concatenate(self._samples))
        m = sample.size
        for g in _groups(self.ranks):
            j, k = g[0] * m // self.n - 64, g[-1] * m // self.n + 64  # the bracket's sample positions; beyond: open
            self._bounds.append((g, sample[j] if j > 0 else None, sample[k] if k < m - 1 else None))
        self._below, self._inside = [0] * len(self._bounds), [[] for _ in self._bounds]

    def count(self, keys: np.ndarray) -> None:
        if not self._bounds:
            self._prepare()
        for i, (_g, lo, hi) in enumerate(self._bounds):
            below, inside = _in_bracket(keys, lo, hi)
            self._below[i] += below
            self._inside[i].append(inside)

    def select(self) -> dict[int, int] | None:
        out: dict[int, int] = {}
        for (g, _lo, _hi), below, parts in zip(self._bounds, self._below, self._inside):
            got = _pick(g, below, np.concatenate(parts))
            if got is None:
                return None
            out.update(got)
        return out


def _order_stats(keys: np.ndarray, ranks: list[int]) -> dict[int, int] | None:
    """{rank: the rank-th smallest of keys} from a sorted sample's brackets; None when the array is
    small or a bracket misses (the caller then partitions the whole array)."""
    if keys.size < SAMPLED_FROM:
        return None
    b = Brackets(keys.size, ranks)
    b.sample(0, keys)
    b.count(keys)
    return b.select()


def percentiles_from(n: int, stats: dict[int, int] | None, values: np.ndarray | None) -> tuple[float, float, float]:
    """Interpolate from order statistics `stats` (int64 keys by rank), or else partition `values`
    (all n values, 1-D float64, reordered in place)."""
    virtual, prev_i, next_i, ranks = _ranks(n)
    if stats is None:
        values.view(np.int64).partition(ranks)
        lo, hi = values[prev_i], values[next_i]
    else:
        lo, hi = (np.array([stats[int(i) % n] for i in idx], np.int64).view(np.float64) for idx in (prev_i, next_i))
    return _interpolate(lo, hi, virtual, prev_i)


def abs_percentiles(values: np.ndarray) -> tuple[float, float, float]:
    """p50, p90, p99 of finite non-negative float64 `values` (1-D, reordered in place): exactly
    ``np.percentile(values, [50, 90, 99])`` (method "linear"), the interpolation repeating numpy 2.4's
    ``_quantile`` and ``_lerp`` operation for operation."""
    n = values.size
    return percentiles_from(n, _order_stats(values.view(np.int64), _ranks(n)[3]), values)


def ranks_of(n: int) -> list[int]:
    """The ranks whose order statistics the three percentiles of n values need."""
    return _ranks(n)[3]
