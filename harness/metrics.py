"""Error metrics of a tensor against a reference; pure functions of numpy arrays.

With d = test - ref over all elements, computed in float64:

    mse     = mean(d^2)                  mae  = mean(|d|)          rmse = sqrt(mse)
    max_abs = max |d|, with its index    rel_l2 = ||d|| / ||ref||
    sqnr_db = 10 * log10(sum ref^2 / sum d^2)   (+inf when d = 0)
    cosine  = <ref, test> / (||ref|| ||test||)  pearson = correlation of the flattened arrays
    p50, p90, p99 = percentiles of |d| (linear interpolation)

Edge cases are defined, never None: identical arrays give mse 0, rel_l2 0 and
sqnr +inf; a zero reference with d != 0 gives rel_l2 nan and sqnr -inf; cosine
and pearson are nan when an input has zero norm or zero variance.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

__all__ = ["METRIC_NAMES", "METRICS", "error_metrics", "tensor_stats", "mse", "mae", "rmse", "max_abs", "rel_l2", "sqnr_db", "cosine",
           "pearson"]

METRIC_NAMES = ("mse", "mae", "rmse", "max_abs", "max_abs_index", "rel_l2", "sqnr_db", "cosine", "pearson",
                "p50", "p90", "p99")


def _dot(a: np.ndarray, b: np.ndarray) -> float:
    """Sum of a * b without BLAS: numpy's BLAS threads keep spinning after a call and slow the
    torch work that follows (measured: the next layer forward ran 2x slower)."""
    return float(np.sum(a * b))


def _norm(a: np.ndarray) -> float:
    return math.sqrt(_dot(a, a))


def _d(ref: np.ndarray, test: np.ndarray) -> np.ndarray:
    if ref.shape != test.shape:
        raise ValueError(f"shape mismatch: reference {list(ref.shape)} vs test {list(test.shape)}")
    return test.astype(np.float64) - ref.astype(np.float64)


def _flat64(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float64).reshape(-1)


def _ratio(num: float, den: float) -> float:
    if num == 0.0:
        return 0.0
    return float("nan") if den == 0.0 else num / den


def _sqnr(d: np.ndarray, ref64: np.ndarray) -> float:
    noise, signal = float(np.sum(d * d)), float(np.sum(ref64 * ref64))
    if noise == 0.0:
        return math.inf
    return -math.inf if signal == 0.0 else 10.0 * math.log10(signal / noise)


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    den = float(_norm(a) * _norm(b))
    return float("nan") if den == 0.0 else float(_dot(a, b) / den)


def _max_abs(a: np.ndarray) -> tuple[float, list[int]]:
    flat = int(np.argmax(a))
    return float(a.reshape(-1)[flat]), [int(i) for i in np.unravel_index(flat, a.shape)]


def mse(ref: np.ndarray, test: np.ndarray) -> float:
    return float(np.mean(_d(ref, test) ** 2))


def mae(ref: np.ndarray, test: np.ndarray) -> float:
    return float(np.mean(np.abs(_d(ref, test))))


def rmse(ref: np.ndarray, test: np.ndarray) -> float:
    return math.sqrt(mse(ref, test))


def max_abs(ref: np.ndarray, test: np.ndarray) -> tuple[float, list[int]]:
    """Largest |d| and its index (first occurrence), e.g. (batch, token, channel)."""
    return _max_abs(np.abs(_d(ref, test)))


def rel_l2(ref: np.ndarray, test: np.ndarray) -> float:
    return _ratio(float(_norm(_d(ref, test))), float(_norm(_flat64(ref))))


def sqnr_db(ref: np.ndarray, test: np.ndarray) -> float:
    return _sqnr(_d(ref, test).reshape(-1), _flat64(ref))


def cosine(ref: np.ndarray, test: np.ndarray) -> float:
    return _cosine(_flat64(ref), _flat64(test))


def pearson(ref: np.ndarray, test: np.ndarray) -> float:
    a, b = _flat64(ref), _flat64(test)
    return _cosine(a - a.mean(), b - b.mean())


METRICS: dict[str, Callable[[np.ndarray, np.ndarray], float]] = {
    "mse": mse, "mae": mae, "rmse": rmse, "rel_l2": rel_l2, "sqnr_db": sqnr_db, "cosine": cosine, "pearson": pearson,
}


def error_metrics(ref: np.ndarray, test: np.ndarray) -> dict[str, float | list[int]]:
    """Every metric of METRIC_NAMES for one (reference, test) pair; d is formed once."""
    d = _d(ref, test)
    a, b = _flat64(ref), _flat64(test)
    ad = np.abs(d)
    m = float(np.mean(d * d))
    peak, where = _max_abs(ad)
    p50, p90, p99 = np.percentile(ad, [50, 90, 99])
    return {
        "mse": m, "mae": float(np.mean(ad)), "rmse": math.sqrt(m), "max_abs": peak, "max_abs_index": where,
        "rel_l2": _ratio(float(_norm(d)), float(_norm(a))), "sqnr_db": _sqnr(d.reshape(-1), a),
        "cosine": _cosine(a, b), "pearson": _cosine(a - a.mean(), b - b.mean()),
        "p50": float(p50), "p90": float(p90), "p99": float(p99),
    }


def tensor_stats(values: np.ndarray, codes: np.ndarray | None = None, scale: float | None = None,
                 n_clipped: int | None = None) -> dict:
    """Summary of one captured tensor (float64 statistics; std with ddof 0 like numpy's default).

    For int8 tensors also: the scale, the fraction of codes at -128 or 127
    (saturated) and, where known, the fraction of values clipped into that range.
    """
    v = values.astype(np.float64).reshape(-1)
    mean = float(v.mean())
    nan_count = int(np.isnan(values).sum())
    out = {
        "shape": list(values.shape), "dtype": str(values.dtype), "kind": "int8" if codes is not None else "float",
        "first_10": v[:10].tolist(), "mean": mean, "std": float(np.sqrt(np.mean((v - mean) ** 2))),
        "min": float(values.min()), "max": float(values.max()), "l2": float(np.sqrt(_dot(v, v))),
        "nan_count": nan_count, "inf_count": int(np.isinf(values).sum()), "quantized": codes is not None,
    }
    if codes is not None:
        out["scale"] = scale
        out["saturated_fraction"] = float(((codes == -128) | (codes == 127)).mean())
        out["clipped_fraction"] = None if n_clipped is None else n_clipped / max(1, codes.size)
    return out
