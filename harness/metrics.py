"""Error metrics of a tensor against a reference; pure functions of numpy arrays.

With d = test - ref over all elements, computed in float64:

    mse     = mean(d^2)                  mae  = mean(|d|)          rmse = sqrt(mse)
    max_abs = max |d|, with its index    rel_l2 = ||d|| / ||ref||
    sqnr_db = 10 * log10(sum ref^2 / sum d^2)   (+inf when d = 0)
    cosine  = <ref, test> / (||ref|| ||test||)  pearson = correlation of the flattened arrays
    p50, p90, p99 = percentiles of |d| (linear interpolation)

Edge cases are defined, never None: identical arrays give mse 0, rel_l2 0 and
sqnr +inf; a zero reference with d != 0 gives rel_l2 nan and sqnr -inf; cosine
and pearson are nan when an input has zero norm or zero variance. When either
array is empty or holds NaN or Inf, every metric is nan (max_abs_index is the
first non-finite position). The row's "undefined" maps each nan metric to why.
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

__all__ = ["METRIC_NAMES", "METRICS", "error_metrics", "abs_percentiles", "tensor_stats", "overflow_fractions", "mse", "mae", "rmse", "max_abs", "rel_l2", "sqnr_db", "cosine",
           "pearson"]

METRIC_NAMES = ("mse", "mae", "rmse", "max_abs", "max_abs_index", "rel_l2", "sqnr_db", "cosine", "pearson",
                "p50", "p90", "p99")


def _dot(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> float:
    """Sum of a * b without BLAS: numpy's BLAS threads keep spinning after a call and slow the
    torch work that follows (measured: the next layer forward ran 2x slower). `out`: scratch for a * b."""
    return float(np.sum(np.multiply(a, b, out=out)))


def _norm(a: np.ndarray, out: np.ndarray | None = None) -> float:
    return math.sqrt(_dot(a, a, out))


def _d(ref: np.ndarray, test: np.ndarray) -> np.ndarray:
    if ref.shape != test.shape:
        raise ValueError(f"shape mismatch: reference {list(ref.shape)} vs test {list(test.shape)}")
    # C order whatever the inputs' layout: numpy's sums follow the memory order, so a transposed view
    # would give other last bits than its contiguous copy (a spilled .npy is contiguous)
    return test.astype(np.float64, order="C") - ref.astype(np.float64, order="C")


def _flat64(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float64, order="C").reshape(-1)


def _ratio(num: float, den: float) -> float:
    if num == 0.0:
        return 0.0
    return float("nan") if den == 0.0 else num / den


def _sqnr(d: np.ndarray, ref64: np.ndarray) -> float:
    return _sqnr_sums(float(np.sum(d * d)), float(np.sum(ref64 * ref64)))


def _sqnr_sums(noise: float, signal: float) -> float:
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    ratio = signal / noise  # both finite and > 0 here; the quotient may still underflow to 0 or overflow
    return -math.inf if ratio == 0.0 else (math.inf if math.isinf(ratio) else 10.0 * math.log10(ratio))


_PERCENTS = np.array([50.0, 90.0, 99.0])


def _order_stats(keys: np.ndarray, ranks: list[int]) -> dict[int, int] | None:
    """{rank: the rank-th smallest of keys} from a sorted sample: each run of adjacent ranks is bracketed by
    two sample values lo <= hi; if below = #(keys < lo) <= rank and rank < below + #(lo <= keys <= hi), the
    answer is the (rank - below)-th smallest of the few keys in [lo, hi] (sorted, exactly those occupy
    positions below .. below + count - 1). None when the array is small or a bracket misses (the caller
    then partitions the whole array)."""
    n = keys.size
    if n < 1 << 14:
        return None
    step = n >> 11
    while math.gcd(step, 210) != 1:  # coprime to 2, 3, 5, 7: the sample walks across the channels of (..., C)
        step += 1
    sample = np.sort(keys[::step])
    m, out = sample.size, {}
    groups = [[ranks[0]]]
    for r in ranks[1:]:
        if r == groups[-1][-1] + 1:
            groups[-1].append(r)
        else:
            groups.append([r])
    for g in groups:
        j, k = g[0] * m // n - 64, g[-1] * m // n + 64  # the bracket's sample positions; beyond the sample: open
        lo, hi = (sample[j] if j > 0 else None), (sample[k] if k < m - 1 else None)
        ge, le = (None if lo is None else keys >= lo), (None if hi is None else keys <= hi)
        below = 0 if ge is None else n - int(np.count_nonzero(ge))
        mask = ge if le is None else (le if ge is None else np.logical_and(ge, le, out=ge))
        inside = keys.copy() if mask is None else keys[mask]
        if not (below <= g[0] and g[-1] < below + inside.size):
            return None
        inside.partition([r - below for r in g])
        out.update({r: int(inside[r - below]) for r in g})
    return out


def abs_percentiles(values: np.ndarray) -> tuple[float, float, float]:
    """p50, p90, p99 of finite non-negative float64 `values` (1-D, reordered in place): exactly
    ``np.percentile(values, [50, 90, 99])`` (method "linear"), but the six neighbouring order statistics
    are selected on the int64 view (the bit patterns of non-negative floats sort as the floats do), from a
    sample's brackets (``_order_stats``) or else one partition, instead of a copy partitioned at eight
    ranks; the interpolation repeats numpy 2.4's ``_quantile`` and ``_lerp`` operation for operation."""
    n = values.size
    virtual = (n - 1) * np.true_divide(_PERCENTS, 100)
    prev = np.floor(virtual)
    nxt = prev + 1
    above = virtual >= n - 1
    prev[above], nxt[above] = -1, -1
    prev_i, next_i = prev.astype(np.intp), nxt.astype(np.intp)
    ranks = np.unique(np.concatenate((prev_i, next_i)) % n)
    stats = _order_stats(values.view(np.int64), [int(r) for r in ranks])
    if stats is None:
        values.view(np.int64).partition(ranks)
        lo, hi = values[prev_i], values[next_i]
    else:
        lo, hi = (np.array([stats[int(i) % n] for i in idx], np.int64).view(np.float64) for idx in (prev_i, next_i))
    gamma = np.asanyarray(virtual - prev_i, dtype=virtual.dtype)
    diff = hi - lo
    out = np.add(lo, diff * gamma)
    np.subtract(hi, diff * (1 - gamma), out=out, where=gamma >= 0.5, casting="unsafe", dtype=type(out.dtype))
    return float(out[0]), float(out[1]), float(out[2])


def _cosine(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> float:
    den = float(_norm(a, out) * _norm(b, out))
    return float("nan") if den == 0.0 else float(_dot(a, b, out) / den)


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


def _position(mask: np.ndarray) -> list[int]:
    flat = int(np.argmax(mask.reshape(-1)))
    return [int(i) for i in np.unravel_index(flat, mask.shape)]


def _nonfinite_note(name: str, a: np.ndarray) -> tuple[str, list[int]] | None:
    if a.dtype.kind != "f":
        return None
    bad = ~np.isfinite(a)
    if not bad.any():
        return None
    n_nan = int(np.isnan(a).sum())
    pos = _position(bad)
    return f"the {name} holds {n_nan} NaN and {int(bad.sum()) - n_nan} Inf values (first at {tuple(pos)})", pos


def _row_plain(ref: np.ndarray, test: np.ndarray) -> dict:
    """The metrics by their single formulas (inputs whose float64 difference is not C-ordered)."""
    row = {name: fn(ref, test) for name, fn in METRICS.items()}
    row["max_abs"], row["max_abs_index"] = max_abs(ref, test)
    row["p50"], row["p90"], row["p99"] = (float(p) for p in np.percentile(np.abs(_d(ref, test)), [50, 90, 99]))
    return row


def _row_fast(ref64: np.ndarray, d: np.ndarray, test: np.ndarray) -> dict:
    """The same values as ``_row_plain``, bit for bit: each sum formed once, over the same array in the same
    (C) order as its single formula, with one scratch buffer instead of a fresh temporary per product
    (fresh 8-byte-per-element temporaries cost more in page faults than the arithmetic). ref64 and d
    are this call's own copies and are overwritten: d holds the test in float64 once |d| is taken,
    so three float64 arrays of the input's size are the peak (the logits of a 130m model: 618 MB)."""
    a, flat, buf = ref64.reshape(-1), d.reshape(-1), np.empty(d.size)
    sq = np.multiply(flat, flat, out=buf)  # mse, ||d|| and the sqnr's noise: one sum over d * d
    m, dd = float(np.mean(sq)), float(np.sum(sq))
    aa = float(np.sum(np.multiply(a, a, out=buf)))
    ad = np.abs(d, out=buf.reshape(d.shape))
    peak, where = _max_abs(ad)
    mae = float(np.mean(ad))
    p50, p90, p99 = abs_percentiles(buf)  # reorders buf: after every other use of |d|
    b = flat
    np.copyto(b, test.reshape(-1))  # the test in float64 (exact), where d was
    bb, ab = (float(np.sum(np.multiply(x, y, out=buf))) for x, y in ((b, b), (a, b)))
    norm_a = math.sqrt(aa)
    den = norm_a * math.sqrt(bb)
    centred = np.subtract(a, a.mean(), out=a), np.subtract(b, b.mean(), out=b)
    return {"mse": m, "mae": mae, "rmse": math.sqrt(m), "max_abs": peak, "max_abs_index": where,
            "rel_l2": _ratio(math.sqrt(dd), norm_a), "sqnr_db": _sqnr_sums(dd, aa),
            "cosine": math.nan if den == 0.0 else float(ab / den), "pearson": _cosine(*centred, buf),
            "p50": p50, "p90": p90, "p99": p99}


def error_metrics(ref: np.ndarray, test: np.ndarray) -> dict[str, float | list[int]]:
    """Every metric of METRIC_NAMES for one (reference, test) pair; d is formed once.

    Also "undefined": {metric: reason} for every metric that is nan.
    """
    ref, test = np.asarray(ref), np.asarray(test)
    if ref.shape != test.shape:
        raise ValueError(f"shape mismatch: reference {list(ref.shape)} vs test {list(test.shape)}")
    bad = None
    if ref.size == 0:
        bad = ("both arrays are empty", [])
    else:
        notes = [n for n in (_nonfinite_note("mode's array", test), _nonfinite_note("reference", ref)) if n]
        if notes:
            bad = ("; ".join(n[0] for n in notes), notes[0][1])
    if bad is not None:
        row: dict = {name: math.nan for name in METRIC_NAMES}
        row["max_abs_index"] = bad[1]
        row["undefined"] = {name: bad[0] for name in METRIC_NAMES if name != "max_abs_index"}
        return row
    ref64 = ref.astype(np.float64)
    d = test.astype(np.float64)  # a copy, then d in place: no third float64 array
    np.subtract(d, ref64, out=d)
    row = _row_fast(ref64, d, test) if d.flags.c_contiguous else _row_plain(ref, test)
    reasons = {"rel_l2": "the reference is all zeros (||ref|| = 0) but the mode is not",
               "cosine": "an array is all zeros (zero norm)", "pearson": "an array is constant (zero variance)"}
    undefined = {k: why for k, why in reasons.items() if math.isnan(row[k])}
    if undefined:
        row["undefined"] = undefined
    return row


def overflow_fractions(values: np.ndarray, dtype: str | None) -> tuple[float, float]:
    """(upper, lower): fractions of the values above +max / below -max of `dtype`'s finite range.

    `dtype` is the float dtype the tensor had where it was captured (float16, float32, ...);
    a value there cannot exceed the range, so these count the values that overflowed to +inf / -inf.
    """
    if values.size == 0:
        return 0.0, 0.0
    limit = float(np.finfo(np.dtype(dtype or values.dtype)).max)
    return float((values > limit).sum() / values.size), float((values < -limit).sum() / values.size)


def tensor_stats(values: np.ndarray, codes: np.ndarray | None = None, scale: float | None = None,
                 n_clipped: int | None = None, source_dtype: str | None = None) -> dict:
    """Summary of one captured tensor (float64 statistics; std with ddof 0 like numpy's default).

    For int8 tensors also: the scale, the fraction of codes at -128 or 127
    (saturated) and, where known, the fraction of values clipped into that range.
    For float tensors: overflow_upper / overflow_lower (``overflow_fractions`` of the
    capture dtype `source_dtype`, default the array's dtype).
    """
    v = values.astype(np.float64).reshape(-1)
    empty, first_10 = v.size == 0, v[:10].tolist()
    with np.errstate(all="ignore"):
        mean = math.nan if empty else float(v.mean())
        l2 = float(np.sqrt(_dot(v, v, out=v)))  # v * v in v's own memory, then v again from `values`:
        np.copyto(v, values.reshape(-1))          # the same values with one float64 copy in all
        std = math.nan if empty else float(np.sqrt(np.mean(np.square(np.subtract(v, mean, out=v), out=v))))
    nan_count = int(np.isnan(values).sum())
    out = {
        "shape": list(values.shape), "dtype": str(values.dtype), "kind": "int8" if codes is not None else "float",
        "first_10": first_10, "mean": mean, "std": std,
        "min": math.nan if empty else float(values.min()), "max": math.nan if empty else float(values.max()), "l2": l2,
        "nan_count": nan_count, "inf_count": int(np.isinf(values).sum()), "quantized": codes is not None,
    }
    if codes is not None:
        out["scale"] = scale
        out["saturated_fraction"] = float(((codes == -128) | (codes == 127)).mean())
        out["clipped_fraction"] = None if n_clipped is None else n_clipped / max(1, codes.size)
    else:
        out["capture_dtype"] = source_dtype or str(values.dtype)
        out["overflow_upper"], out["overflow_lower"] = overflow_fractions(values, source_dtype)
    return out
