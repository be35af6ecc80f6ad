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

from .percentiles import Brackets, abs_percentiles, percentiles_from, ranks_of

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


_LEAF = 1 << 18  # elements per chunk: four 2 MB float64 scratch buffers, reused by every chunk
_PAIRWISE_BLOCK = 128  # numpy's PW_BLOCKSIZE


def _tree(lo: int, hi: int, leaf: Callable[[int, int], list]) -> list:
    """Sums over [lo, hi), each leaf's list of np.sum results combined as numpy (2.4) combines a contiguous
    1-D sum's halves (pairwise_sum in numpy/_core/src/umath/loops_utils.h.src: n2 = n / 2 rounded down to
    a multiple of 8, sum(left) + sum(right)): each total equals np.sum over the whole range, bit for bit,
    while no float64 copy larger than a leaf exists. Leaves are visited left to right."""
    n = hi - lo
    if n <= max(_LEAF, _PAIRWISE_BLOCK):  # numpy splits only above its block of 128
        return leaf(lo, hi)
    n2 = n // 2
    n2 -= n2 % 8
    left, right = _tree(lo, lo + n2, leaf), _tree(lo + n2, hi, leaf)
    return [x + y for x, y in zip(left, right)]


class _Chunks:
    """The reference and the test, flattened in C order, loaded into float64 scratch one chunk at a time."""

    def __init__(self, ref: np.ndarray, test: np.ndarray):
        self.r, self.t = np.ravel(ref), np.ravel(test)  # views, or C-order copies in the input dtype
        m = min(self.r.size, max(_LEAF, _PAIRWISE_BLOCK))
        self.a, self.b, self.d, self.buf = (np.empty(m) for _ in range(4))

    def load(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(ref64, test64, |test64 - ref64|, scratch) of [lo, hi)."""
        k = hi - lo
        a, b, d = self.a[:k], self.b[:k], self.d[:k]
        np.copyto(a, self.r[lo:hi])
        np.copyto(b, self.t[lo:hi])
        np.abs(np.subtract(b, a, out=d), out=d)
        return a, b, d, self.buf[:k]


def _row(ref: np.ndarray, test: np.ndarray) -> dict:
    """Every metric by its single formula's value, bit for bit: each sum taken over the same float64
    elements in C order and combined in numpy's pairwise order (``_tree``), in two passes over chunks:
    the first for the sums, |d|'s peak and the percentiles' sample, the second for the centred sums
    (pearson) and the percentiles' brackets. The logits of a 130m model are never copied whole to
    float64 (they were three 206 MB copies, whose page faults cost more than the arithmetic)."""
    c, n = _Chunks(ref, test), ref.size
    brackets = Brackets(n, ranks_of(n)) if n > _LEAF else None
    peak: list = [-1.0, 0]
    whole: list = []

    def first(lo: int, hi: int) -> list:
        a, b, d, buf = c.load(lo, hi)
        j = int(np.argmax(d))
        if d[j] > peak[0]:
            peak[:] = [float(d[j]), lo + j]
        if brackets is not None:
            brackets.sample(lo, d.view(np.int64))
        else:
            whole.append(d.copy())
        sums = [np.sum(d)]
        for x, y in ((d, d), (a, a), (b, b), (a, b)):
            sums.append(np.sum(np.multiply(x, y, out=buf)))
        return sums + [np.sum(a), np.sum(b)]
    ad, dd, aa, bb, ab, sa, sb = _tree(0, n, first)
    mean_a, mean_b = sa / n, sb / n

    def second(lo: int, hi: int) -> list:
        a, b, d, buf = c.load(lo, hi)
        if brackets is not None:
            brackets.count(d.view(np.int64))
        ca, cb = np.subtract(a, mean_a, out=a), np.subtract(b, mean_b, out=b)
        return [np.sum(np.multiply(x, y, out=buf)) for x, y in ((ca, ca), (cb, cb), (ca, cb))]
    cc_a, cc_b, cc_ab = _tree(0, n, second)
    if brackets is None:
        p50, p90, p99 = abs_percentiles(whole[0])
    else:  # a missed bracket (stats None): |d| whole, once
        stats = brackets.select()
        p50, p90, p99 = percentiles_from(n, stats, None if stats is not None else np.abs(_d(ref, test)).reshape(-1))
    norm_a = math.sqrt(aa)
    den = norm_a * math.sqrt(bb)
    den_c = float(math.sqrt(cc_a) * math.sqrt(cc_b))
    m = float(dd / n)
    return {"mse": m, "mae": float(ad / n), "rmse": math.sqrt(m), "max_abs": peak[0],
            "max_abs_index": [int(i) for i in np.unravel_index(peak[1], ref.shape)],
            "rel_l2": _ratio(math.sqrt(dd), norm_a), "sqnr_db": _sqnr_sums(float(dd), float(aa)),
            "cosine": math.nan if den == 0.0 else float(ab / den),
            "pearson": math.nan if den_c == 0.0 else float(cc_ab / den_c), "p50": p50, "p90": p90, "p99": p99}


def error_metrics(ref: np.ndarray, test: np.ndarray) -> dict[str, float | list[int]]:
    """Every metric of METRIC_NAMES for one (reference, test) pair, in two passes over chunks (``_row``).

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
    row = _row(ref, test)
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


def tensor_stats(values: np.ndarray, codes: np.ndarray | None = None, scale: float | dict | None = None,
                 n_clipped: int | None = None, source_dtype: str | None = None) -> dict:
    """Summary of one captured tensor (float64 statistics; std with ddof 0 like numpy's default).

    For int8 tensors also: the scale (a dict: the summary of one scale per channel, ``scales``), the fraction of
    codes at -128 or 127
    (saturated) and, where known, the fraction of values clipped into that range.
    For float tensors: overflow_upper / overflow_lower (``overflow_fractions`` of the
    capture dtype `source_dtype`, default the array's dtype).
    """
    flat, n = np.ravel(values), values.size
    buf = np.empty(min(n, max(_LEAF, _PAIRWISE_BLOCK)))

    empty, first_10 = n == 0, flat[:10].astype(np.float64).tolist()

    def sums(lo: int, hi: int, centre: float | None = None) -> list:
        v = buf[:hi - lo]
        np.copyto(v, flat[lo:hi])
        if centre is not None:
            return [np.sum(np.square(np.subtract(v, centre, out=v), out=v))]
        return [np.sum(v), np.sum(np.square(v, out=v))]
    with np.errstate(all="ignore"):  # the float64 sums of the single formulas, chunk by chunk (``_tree``)
        total, squares = _tree(0, n, sums)
        mean = math.nan if empty else float(total / n)
        l2 = float(np.sqrt(squares))
        (centred,) = _tree(0, n, lambda lo, hi: sums(lo, hi, mean))
        std = math.nan if empty else float(np.sqrt(centred / n))
    nan_count = int(np.isnan(values).sum())
    out = {
        "shape": list(values.shape), "dtype": str(values.dtype), "kind": "int8" if codes is not None else "float",
        "first_10": first_10, "mean": mean, "std": std,
        "min": math.nan if empty else float(values.min()), "max": math.nan if empty else float(values.max()), "l2": l2,
        "nan_count": nan_count, "inf_count": int(np.isinf(values).sum()), "quantized": codes is not None,
    }
    if codes is not None:
        out["scales" if isinstance(scale, dict) else "scale"] = scale  # dict: one scale per channel (a summary)
        out["saturated_fraction"] = float(((codes == -128) | (codes == 127)).mean())
        out["clipped_fraction"] = None if n_clipped is None else n_clipped / max(1, codes.size)
    else:
        out["capture_dtype"] = source_dtype or str(values.dtype)
        out["overflow_upper"], out["overflow_lower"] = overflow_fractions(values, source_dtype)
    return out
