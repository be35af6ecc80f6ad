"""Normalized Hadamard transforms of the sizes Quamba's kernels support.

    Had_n = (H_b kron S_M) / sqrt(n),   n = b * M,  M a power of two,

with S_M the Sylvester matrix in natural order, S[i, j] = (-1)^popcount(i & j),
and H_b one of the base matrices of fast-hadamard-transform
(`csrc/hadamard/fast_hadamard_transform_special.h`, `hadamard_mult_thread_{12,20,28,40}`)
as the outer factor: element c*M + j is chunk c, position j (notes §2.2).
Base selection follows `get_had_fn` (hadamard_utils.py:8-22): 12 first, then 40,
then a power of two; 20 and 28 (kernels that Quamba's Python never selects) come
after 40, so 20 * 2^k with k >= 1 uses the 40 base like Quamba does.

H_12 is symmetric, so Had_n is an involution for n = 2^k and 12 * 2^k; the 20,
28 and 40 bases are not symmetric, and there the inverse is the transpose.
Transforms are computed in float64: a sum of fp16 inputs of width up to a few
thousand is then exact (fp32 inputs: float64-accurate) before the caller's single
rounding.
"""
from __future__ import annotations

import math

import torch

__all__ = ["hadamard_factors", "hadamard_transform", "hadamard_matrix", "SUPPORTED_SIZES_TEXT"]

SUPPORTED_SIZES_TEXT = "2^k, 12*2^k, 20*2^k, 28*2^k or 40*2^k"

# Row r of H_b as signs; out[r] = sum_c sign[r][c] * x[c], as in the kernels.
_BASE_SIGNS: dict[int, tuple[str, ...]] = {
    12: (
        "+-++++++++++",
        "--+-+-+-+-+-",
        "+++-++----++",
        "+---+--+-++-",
        "+++++-++----",
        "+-+---+--+-+",
        "++--+++-++--",
        "+--++---+--+",
        "++----+++-++",
        "+--+-++---+-",
        "++++----+++-",
        "+-+--+-++---",
    ),
    20: (
        "+----+----++--++-++-",
        "-+----+---+++---+-++",
        "--+----+---+++-+-+-+",
        "---+----+---+++++-+-",
        "----+----++--++-++-+",
        "-+++++-----+--+++--+",
        "+-+++-+---+-+--+++--",
        "++-++--+---+-+--+++-",
        "+++-+---+---+-+--+++",
        "++++-----++--+-+--++",
        "--++-+-++-+-----++++",
        "---++-+-++-+---+-+++",
        "+---++-+-+--+--++-++",
        "++---++-+----+-+++-+",
        "-++---++-+----+++++-",
        "-+--+--++-+----+----",
        "+-+-----++-+----+---",
        "-+-+-+---+--+----+--",
        "--+-+++------+----+-",
        "+--+--++------+----+",
    ),
    28: (
        "+------++----++-+--+-+--++--",
        "-+-----+++-----+-+--+-+--++-",
        "--+-----+++---+-+-+----+--++",
        "---+-----+++---+-+-+-+--+--+",
        "----+-----+++---+-+-+++--+--",
        "-----+-----++++--+-+--++--+-",
        "------++----++-+--+-+--++--+",
        "--++++-+-------++--+++-+--+-",
        "---++++-+-----+-++--+-+-+--+",
        "+---+++--+----++-++--+-+-+--",
        "++---++---+----++-++--+-+-+-",
        "+++---+----+----++-++--+-+-+",
        "++++--------+-+--++-++--+-+-",
        "-++++--------+++--++--+--+-+",
        "-+-++-++--++--+--------++++-",
        "+-+-++--+--++--+--------++++",
        "-+-+-++--+--++--+----+---+++",
        "+-+-+-++--+--+---+---++---++",
        "++-+-+-++--+------+--+++---+",
        "-++-+-+-++--+------+-++++---",
        "+-++-+---++--+------+-++++--",
        "-++--++-+-++-+++----++------",
        "+-++--++-+-++-+++-----+-----",
        "++-++---+-+-++-+++-----+----",
        "-++-++-+-+-+-+--+++-----+---",
        "--++-++++-+-+----+++-----+--",
        "+--++-+-++-+-+----+++-----+-",
        "++--++-+-++-+-+----++------+",
    ),
    40: (
        "+-------------------+-------------------",
        "++-++----+-+-++++--+++-++----+-+-++++--+",
        "+++-++----+-+-++++--+++-++----+-+-++++--",
        "+-++-++----+-+-++++-+-++-++----+-+-++++-",
        "+--++-++----+-+-+++++--++-++----+-+-++++",
        "++--++-++----+-+-+++++--++-++----+-+-+++",
        "+++--++-++----+-+-+++++--++-++----+-+-++",
        "++++--++-++----+-+-+++++--++-++----+-+-+",
        "+++++--++-++----+-+-+++++--++-++----+-+-",
        "+-++++--++-++----+-++-++++--++-++----+-+",
        "++-++++--++-++----+-++-++++--++-++----+-",
        "+-+-++++--++-++----++-+-++++--++-++----+",
        "++-+-++++--++-++----++-+-++++--++-++----",
        "+-+-+-++++--++-++---+-+-+-++++--++-++---",
        "+--+-+-++++--++-++--+--+-+-++++--++-++--",
        "+---+-+-++++--++-++-+---+-+-++++--++-++-",
        "+----+-+-++++--++-+++----+-+-++++--++-++",
        "++----+-+-++++--++-+++----+-+-++++--++-+",
        "+++----+-+-++++--++-+++----+-+-++++--++-",
        "+-++----+-+-++++--+++-++----+-+-++++--++",
        "+--------------------+++++++++++++++++++",
        "++-++----+-+-++++--+--+--++++-+-+----++-",
        "+++-++----+-+-++++-----+--++++-+-+----++",
        "+-++-++----+-+-++++--+--+--++++-+-+----+",
        "+--++-++----+-+-++++-++--+--++++-+-+----",
        "++--++-++----+-+-+++--++--+--++++-+-+---",
        "+++--++-++----+-+-++---++--+--++++-+-+--",
        "++++--++-++----+-+-+----++--+--++++-+-+-",
        "+++++--++-++----+-+------++--+--++++-+-+",
        "+-++++--++-++----+-+-+----++--+--++++-+-",
        "++-++++--++-++----+---+----++--+--++++-+",
        "+-+-++++--++-++----+-+-+----++--+--++++-",
        "++-+-++++--++-++------+-+----++--+--++++",
        "+-+-+-++++--++-++----+-+-+----++--+--+++",
        "+--+-+-++++--++-++---++-+-+----++--+--++",
        "+---+-+-++++--++-++--+++-+-+----++--+--+",
        "+----+-+-++++--++-++-++++-+-+----++--+--",
        "++----+-+-++++--++-+--++++-+-+----++--+-",
        "+++----+-+-++++--++----++++-+-+----++--+",
        "+-++----+-+-++++--++-+--++++-+-+----++--",
    ),
}
_BASE_ORDER = (12, 40, 20, 28)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def hadamard_factors(n: int) -> tuple[int, int]:
    """(b, M) with n = b * M: the base matrix size (1 for pure Sylvester) and the power of two."""
    for b in _BASE_ORDER:
        if n % b == 0 and _is_pow2(n // b):
            return b, n // b
    if _is_pow2(n):
        return 1, n
    raise ValueError(f"no Hadamard transform of size {n}: the rotation supports sizes {SUPPORTED_SIZES_TEXT} "
                     f"(the sizes of Quamba's Hadamard kernels)")


def _base_matrix(b: int) -> torch.Tensor:
    if b == 1:
        return torch.ones(1, 1, dtype=torch.float64)
    return torch.tensor([[1.0 if s == "+" else -1.0 for s in row] for row in _BASE_SIGNS[b]], dtype=torch.float64)


def _sylvester(m: int) -> torch.Tensor:
    idx = torch.arange(m)
    bits = torch.bitwise_and(idx[:, None], idx[None, :])
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    return 1.0 - 2.0 * parity.to(torch.float64)


def hadamard_transform(x: torch.Tensor, normalized: bool = True, transpose: bool = False) -> torch.Tensor:
    """Had_n @ v for every vector v along the last dim (Had_n.T @ v with transpose=True).

    x: (..., n) any float dtype -> (..., n) float64. normalized=False omits 1/sqrt(n)
    (the online QHadamard applies the scale in its quantization step).
    """
    n = x.shape[-1]
    b, m = hadamard_factors(n)
    lead = x.shape[:-1]
    y = x.to(torch.float64, copy=True).reshape(-1, b, m)  # a copy: the passes write into it
    buf = torch.empty_like(y)
    h = 1
    while h < m:  # Sylvester butterflies, one bit of the position index per pass, ping-ponging two buffers
        src, dst = y.view(-1, b, m // (2 * h), 2, h), buf.view(-1, b, m // (2 * h), 2, h)
        torch.add(src[..., 0, :], src[..., 1, :], out=dst[..., 0, :])
        torch.sub(src[..., 0, :], src[..., 1, :], out=dst[..., 1, :])
        y, buf = buf, y
        h *= 2
    if b > 1:
        base = _base_matrix(b)
        y = (base.t() if transpose else base) @ y   # out[c, j] = sum_d H[c, d] y[d, j]
    y = y.reshape(*lead, n)
    return y * (1.0 / math.sqrt(n)) if normalized else y


def hadamard_matrix(n: int) -> torch.Tensor:
    """Oracle: the explicit (n, n) float64 matrix Had_n = (H_b kron S_M) / sqrt(n)."""
    b, m = hadamard_factors(n)
    return torch.kron(_base_matrix(b), _sylvester(m)) / math.sqrt(n)
