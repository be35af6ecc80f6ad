"""Across-sample statistics: mean with a 95 % confidence interval, and paired differences of two modes.

Method (docs/analysis.md): Student t on the per-sample values. For n values x_1..x_n
with mean m and sample standard deviation s (n - 1 in the denominator), the interval is
m +- t_{0.975, n-1} * s / sqrt(n). With n = 1 there is no spread to measure and the interval
is [m, m]. A paired difference of modes a and b takes d_k = metric_a(k) - metric_b(k) on the
same sample k and gives the interval of the d_k the same way (a paired t interval).
Non-finite per-sample values (an infinite SQNR of a bit-identical sample) make the interval
non-finite: it is reported, never hidden.
"""
from __future__ import annotations

import math

import numpy as np

__all__ = ["t_critical", "mean_ci", "paired_difference"]

# t_{0.975, df} for df = 1..30 (standard tables, 4 decimals)
_T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
         2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
         2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423)
_Z975 = 1.959963984540054


def t_critical(df: int) -> float:
    """Two-sided 95 % quantile t_{0.975, df}: the table up to 30, beyond it the Cornish-Fisher
    expansion of the t quantile in 1/df (error below 1e-4 for df > 30)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3))


def mean_ci(values) -> dict:
    """{"mean", "ci95": [lo, hi], "per_sample": [...]} of per-sample values (floats)."""
    x = np.asarray([float(v) for v in values], dtype=np.float64)
    if x.size == 0:
        raise ValueError("no values")
    mean = float(x.mean())
    if x.size == 1 or not np.all(np.isfinite(x)):
        half = 0.0 if x.size == 1 and math.isfinite(mean) else math.nan
    else:
        half = t_critical(x.size - 1) * float(x.std(ddof=1)) / math.sqrt(x.size)
    lo, hi = (mean - half, mean + half) if math.isfinite(half) else (math.nan, math.nan)
    return {"mean": mean, "ci95": [lo, hi], "per_sample": [float(v) for v in x]}


def paired_difference(a, b) -> dict:
    """Mean of a_k - b_k over samples with its paired t interval: {"mean_diff", "ci95"}."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired values need the same samples, got {a.shape} and {b.shape}")
    stats = mean_ci(a - b)
    return {"mean_diff": stats["mean"], "ci95": stats["ci95"]}
