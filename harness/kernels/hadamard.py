"""Normalized Hadamard transforms of the sizes Quamba's kernels support.

    Had_n = (H_b kron S_M) / sqrt(n),   n = b * M,  M a power of two,

with S_M the Sylvester matrix in natural order, S[i, j] = (-1)^popcount(i & j),
and H_b one of the base matrices of fast-hadamard-transform
(`csrc/hadamard/fast_hadamard_transform_special.h`, `hadamard_mult_thread_{12,20,28,40}`)
as the outer factor: element c*M + j is chunk c, position j (spec notes §2.2).
Base selection follows `get_had_fn` (hadamard_utils.py:8-22): 12 first, then 40,
then a power of two; 20 and 28 (kernels that Quamba's Python never selects) come
after 40, so 20 * 2^k with k >= 1 uses the 40 base like Quamba does.

H_12 is symmetric, so Had_n is an involution for n = 2^k and 12 * 2^k; the 20,
28 and 40 bases are not symmetric, and there the inverse is the transpose.
``hadamard_transform`` computes in float64 in a fixed order: a sum of fp16 inputs of
width up to a few thousand is then exact (fp32 inputs: float64-accurate, the same bits
on every CPU) before the caller's single rounding (prep=exact). ``hadamard_transform_fht`` reproduces the fp32
arithmetic of the fast_hadamard_transform kernel instead (prep=quamba), and
``quamba_kernel_support`` says which widths Quamba's kernels actually transform.
"""
from __future__ import annotations

import math

import torch

__all__ = ["hadamard_factors", "hadamard_transform", "hadamard_matrix", "hadamard_transform_fht", "quamba_kernel_support",
           "SUPPORTED_SIZES_TEXT"]

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


def _base_matrix(b: int, device: torch.device | None = None) -> torch.Tensor:
    if b == 1:
        return torch.ones(1, 1, dtype=torch.float64, device=device)
    return torch.tensor([[1.0 if s == "+" else -1.0 for s in row] for row in _BASE_SIGNS[b]], dtype=torch.float64,
                        device=device)


def _sylvester(m: int) -> torch.Tensor:
    idx = torch.arange(m)
    bits = torch.bitwise_and(idx[:, None], idx[None, :])
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    return 1.0 - 2.0 * parity.to(torch.float64)


def _butterflies(x: torch.Tensor, dtype: torch.dtype, b: int, m: int) -> torch.Tensor:
    """(..., b*m) -> (-1, b, m) in `dtype`: the Sylvester_m butterflies within each of the b chunks, one bit of
    the position index per pass from the lowest up (a + b, a - b), ping-ponging two buffers."""
    y = x.to(dtype, copy=True).reshape(-1, b, m)  # a copy: the passes write into it
    buf = torch.empty_like(y)
    h = 1
    while h < m:
        src, dst = y.view(-1, b, m // (2 * h), 2, h), buf.view(-1, b, m // (2 * h), 2, h)
        torch.add(src[..., 0, :], src[..., 1, :], out=dst[..., 0, :])
        torch.sub(src[..., 0, :], src[..., 1, :], out=dst[..., 1, :])
        y, buf = buf, y
        h *= 2
    return y


# float64 elements per pass of hadamard_transform: a block of rows whose buffers stay in the cache (1 MB each).
# Every op is elementwise within a row, so a row's result does not depend on the rows transformed with it; the
# 50280 x 768 lm_head in one pass made three 309 MB float64 temporaries (1.6 s; in blocks 0.5 s).
_ROWS_ELEMENTS = 1 << 17


def hadamard_transform(x: torch.Tensor, normalized: bool = True, transpose: bool = False) -> torch.Tensor:
    """Had_n @ v for every vector v along the last dim (Had_n.T @ v with transpose=True).

    x: (..., n) any float dtype -> (..., n) float64. normalized=False omits 1/sqrt(n)
    (the online QHadamard applies the scale in its quantization step). Computed in blocks of rows.
    """
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    step = max(1, _ROWS_ELEMENTS // n)
    if rows.shape[0] <= step:
        return _hadamard_rows(rows, normalized, transpose).reshape(x.shape)
    out = torch.empty(rows.shape, dtype=torch.float64, device=x.device)
    for start in range(0, rows.shape[0], step):
        out[start:start + step] = _hadamard_rows(rows[start:start + step], normalized, transpose)
    return out.reshape(x.shape)


def _hadamard_rows(x: torch.Tensor, normalized: bool, transpose: bool) -> torch.Tensor:
    """hadamard_transform of x: (rows, n) -> (rows, n) float64, a buffer of its own."""
    n = x.shape[-1]
    b, m = hadamard_factors(n)
    lead = x.shape[:-1]
    y = _butterflies(x, torch.float64, b, m)
    if b > 1:
        # out[c] = sum_d H[c, d] y[d] term by term in float64 (H = +-1: each product exact): a fixed
        # order, where a matmul's order (MKL's, by CPU) could move the last bit of an fp32 input's sum.
        # In place (addcmul_: the product by +-1 is exact, so a fused multiply-add rounds as mul then add):
        # no temporary of the whole matrix per term (the 50280 x 768 lm_head: 2.2x faster)
        base = _base_matrix(b, x.device)  # beside x: a captured value is transformed back on the CPU
        signs = (base.t() if transpose else base)[:, :, None]               # (b rows, b terms, 1)
        acc = y[:, None, 0, :] * signs[:, 0]                                # (batch, b, m)
        for d in range(1, b):
            acc.addcmul_(y[:, None, d, :], signs[:, d])
        y = acc
    y = y.reshape(*lead, n)  # y is this call's own buffer (_butterflies copies x): scaled in place
    return y.mul_(1.0 / math.sqrt(n)) if normalized else y


def hadamard_transform_fht(x: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Had_n @ v with the arithmetic of the fast_hadamard_transform kernel, for every v along the last dim.

    x: (..., n) fp32 holding the kernel's input values (fp16 or fp32) -> (..., n) fp32, before the
    caller's store (fp16 for an fp16 tensor). scale: the kernel's `float scale` argument
    (default 1/sqrt(n), what `get_had_fn` passes, hadamard_utils.py:9); the value is rounded to fp32.

    The CUDA kernel (3rdparty/fast-hadamard-transform/csrc/fast_hadamard_transform_cuda.cu:154-227,
    the same code as Quamba's csrc/hadamard) loads the inputs as float (common.h:129-143), runs fp32
    butterflies (a + b, a - b) one bit of the position index at a time from the lowest bit up: the bits
    inside a thread (common.h:87-104), across lanes (hadamard_mult_warp, common.h:107-124: sign * x +
    other, the same value as a - b), across warps, then across power-of-two chunks; for 12N/20N/28N/40N
    the base matrix then multiplies across the chunks as one left-to-right fp32 sum per output
    (`+ x[0] - x[1] + x[2] ...`, fast_hadamard_transform_special.h:12-28); store_output multiplies by
    `scale` in fp32 (common.h:146-157). Every fp32 step is reproduced here with torch fp32 ops (IEEE
    add/sub/mul, no reassociation, no FMA: the kernel has no multiply-add to contract).
    """
    n = x.shape[-1]
    b, m = hadamard_factors(n)
    lead = x.shape[:-1]
    y = _butterflies(x, torch.float32, b, m)
    if b > 1:
        # out[r] = ((s_r0 x_0 + s_r1 x_1) + s_r2 x_2) + ... in fp32, term by term, all rows r at once:
        # s_rc * x_c is exact (s = +-1), so acc + s_rc * x_c rounds exactly like the kernel's acc +- x_c
        signs = _base_matrix(b).to(torch.float32)[:, :, None]               # (b rows, b terms, 1)
        acc = y[:, None, 0, :] * signs[:, 0]                                # (batch, b, m)
        for c in range(1, b):
            acc.addcmul_(y[:, None, c, :], signs[:, c])  # acc + s * y_c: s * y_c exact, so one rounding either way
        y = acc
    factor = torch.tensor(1.0 / math.sqrt(n) if scale is None else scale, dtype=torch.float32)
    return (y * factor).reshape(*lead, n)


def quamba_kernel_support(n: int) -> str | None:
    """None when Quamba's Hadamard kernels transform width n; else the reason they do not.

    `get_had_fn`/`get_qhad_fn` (hadamard_utils.py:8-22, 33-47) pick 12N when 12 divides n (asserting
    n/12 is a power of two), else 40N when 40 divides n, else the power-of-two kernel (asserting
    it). The C++ wrappers pad n to a multiple of 8 (power of two) or 4*b (b = 12, 40) and take
    log_N = ceil(log2(padded/b)) (fast_hadamard_transform.cpp:59, 89-95, 132-138; quant_hadamard.cpp
    the same); the launchers reach log_N 3..15 (power of two) and, for 12N and 40N, log_N 2 and 4..10:
    the second branch tests `log_N == 2` again instead of 3 (fast_hadamard_transform_cuda.cu:292-295;
    quant_hadamard_fwd.cu:292-295), so 12 * 8 = 96 and 40 * 8 = 320 never launch. A padded width is
    a different transform, so it counts as unsupported too.
    """
    if n % 12 == 0:
        base, kernel, reached = 12, "12N", (2, *range(4, 11))
    elif n % 40 == 0:
        base, kernel, reached = 40, "40N", (2, *range(4, 11))
    else:
        base, kernel, reached = 1, "power-of-two", tuple(range(3, 16))
    m = n // base
    if not _is_pow2(m):
        return (f"get_had_fn rejects width {n}: it picks the {kernel} kernel and asserts {m} is a power of two"
                if base > 1 else f"get_had_fn rejects width {n}: not 12*2^k, 40*2^k or a power of two")
    k = m.bit_length() - 1
    if k not in reached:
        how = "zero-pads it to a wider transform" if k < reached[0] else "never launches it"
        return (f"the {kernel} kernel does not transform width {n}: log_N = {k}, its launcher reaches log_N "
                f"{reached[0]}{', 4..10' if base > 1 else '..15'}, so it {how}")
    return None


def hadamard_matrix(n: int) -> torch.Tensor:
    """Oracle: the explicit (n, n) float64 matrix Had_n = (H_b kron S_M) / sqrt(n)."""
    b, m = hadamard_factors(n)
    return torch.kron(_base_matrix(b), _sylvester(m)) / math.sqrt(n)
