"""The paired difference of a mode from the reference mode over the same examples, with a bootstrap interval.

Every metric of an lm-eval task is an aggregation of per-example values (lm-eval 0.4.13, lm_eval/api/metrics.py):
``mean`` (acc), ``perplexity`` (exp of minus the mean log-likelihood), ``weighted_perplexity`` (exp of minus the
summed log-likelihood over the summed words or bytes; the values are (loglikelihood, count) pairs) and
``bits_per_byte`` (the same sum over bytes, in bits). The paired bootstrap resamples the *examples* (the same
indices for both modes), so the interval of the difference excludes the examples' own spread that an unpaired
comparison of two intervals would carry.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

__all__ = ["AGGREGATIONS", "aggregate", "paired_difference", "flipped", "as_array"]


def _mean(v: np.ndarray) -> np.ndarray:
    return v.mean(axis=-1)


def _perplexity(v: np.ndarray) -> np.ndarray:
    return np.exp(-v.mean(axis=-1))


def _weighted_perplexity(v: np.ndarray) -> np.ndarray:
    return np.exp(-v[..., 0].sum(axis=-1) / v[..., 1].sum(axis=-1))


def _bits_per_byte(v: np.ndarray) -> np.ndarray:
    return -v[..., 0].sum(axis=-1) / v[..., 1].sum(axis=-1) / math.log(2)


# aggregation name -> function of per-example values (n,) or pairs (n, 2); a leading resample axis is allowed
AGGREGATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "mean": _mean, "perplexity": _perplexity, "weighted_perplexity": _weighted_perplexity,
    "bits_per_byte": _bits_per_byte}


def as_array(values: list) -> np.ndarray:
    """Per-example values (numbers, or lm-eval's (loglikelihood, count) pairs) as float64 (n,) or (n, 2)."""
    return np.asarray([list(v) if isinstance(v, (list, tuple)) else float(v) for v in values], dtype=np.float64)


def aggregate(aggregation: str, values: list) -> float:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"no paired statistic for aggregation {aggregation!r}; known: {', '.join(AGGREGATIONS)}")
    return float(AGGREGATIONS[aggregation](as_array(values)))


def paired_difference(aggregation: str, mode: list, reference: list, *, iters: int = 1000, seed: int = 0,
                      level: float = 0.95) -> dict:
    """mode's aggregate minus the reference's over the same examples (equal length, same order), and the
    percentile interval of that difference over `iters` paired bootstrap resamples (seeded)."""
    if len(mode) != len(reference):
        raise ValueError(f"paired values differ in length: {len(mode)} vs {len(reference)}")
    fn = AGGREGATIONS[aggregation]
    a, b = as_array(mode), as_array(reference)
    point = float(fn(a) - fn(b))
    out = {"difference": point, "n": len(mode), "aggregation": aggregation, "level": level, "iters": iters}
    if len(mode) < 2 or iters <= 0:
        return {**out, "low": None, "high": None}
    idx = np.random.default_rng(seed).integers(0, len(mode), size=(iters, len(mode)))
    with np.errstate(all="ignore"):
        diffs = fn(a[idx]) - fn(b[idx])
    diffs = diffs[np.isfinite(diffs)]
    if diffs.size == 0:
        return {**out, "low": None, "high": None}
    lo, hi = np.quantile(diffs, [(1 - level) / 2, (1 + level) / 2])
    return {**out, "low": float(lo), "high": float(hi)}


def flipped(doc_ids: list[int], mode: list, reference: list) -> dict[str, list[int]]:
    """For a 0/1 metric (acc): the examples the mode lost (reference right, mode wrong) and gained."""
    lost = [d for d, m, r in zip(doc_ids, mode, reference) if float(r) > float(m)]
    gained = [d for d, m, r in zip(doc_ids, mode, reference) if float(m) > float(r)]
    return {"lost": lost, "gained": gained}
