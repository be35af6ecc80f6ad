"""Elementary functions whose bits are the same on every CPU.

torch's own ``exp``, ``log1p``, ``sigmoid``, ``silu``, ``softplus``, ``sqrt`` and ``rsqrt``
take different code paths by CPU: MKL's vector math library picks its kernels by
instruction set (``MKL_CBWR`` changes the bits of ``torch.exp`` and ``torch.sqrt``), ATen's
vectorised and scalar builds differ (``ATEN_CPU_CAPABILITY=default`` changes ``sigmoid``,
``silu``, ``log1p``), and aarch64 has neither. Measured on one Xeon (AVX-512): all of these
change bits when only the code path changes; see docs/determinism.md.

Every function here is built from operations that IEEE 754 defines to the bit on every
machine: one ``+``, ``-``, ``*`` or ``/`` per kernel (never two in one kernel, so no
compiler can contract them into an FMA), float<->float casts, comparisons, integer
shifts and copies. The same inputs therefore give the same outputs on AVX2, AVX-512
and Arm. They are accurate to about 2^-45 relative before the final rounding to fp32
(``exp``, ``log1p``) or correctly rounded (``sqrt``); the GPU kernels Quamba runs use
``__expf``-class approximations that no CPU reproduces either (docs/fidelity.md).

Shapes: every function is elementwise, ``x: (...) fp32 -> (...) fp32``, except
``sum_last`` (``(..., n) -> (..., 1)``).
"""
from __future__ import annotations

import decimal
import math

import torch

from .rounding import round_half_even

__all__ = ["exp", "exp_", "log", "log1p", "sigmoid", "silu", "softplus", "sqrt", "sum_last", "mean_last"]

# exp(x) = 2^m * 2^(j/256) * exp(r) with k = round(x * 256 / ln 2) = 256 m + j and r = x - k ln2 / 256,
# |r| <= ln2 / 512. ln 2 is split Cody-Waite style (fdlibm e_exp.c): _LN2_HI has its low 21 bits zero,
# so k * _LN2_HI / 256 is exact for |k| < 2**21. exp(r) = 1 + r + r^2/2 + r^3/6 leaves r^4/24 < 2^-42.
# The table values 2^(j/256) and the constant 256 / ln 2 come from the decimal module (pure software,
# exp and ln correctly rounded at 60 digits, then one rounding to float64), not from the platform's
# libm, whose pow and log need not be correctly rounded or the same on another machine.
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_TABLE_BITS = 8


def _decimal_constants() -> tuple[tuple[float, ...], float]:
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        ln2 = decimal.Decimal(2).ln()
        table = tuple(float((ln2 * j / (1 << _TABLE_BITS)).exp()) for j in range(1 << _TABLE_BITS))
        return table, float((1 << _TABLE_BITS) / ln2)


_EXP_TABLE, _INV_LN2_STEP = _decimal_constants()  # 2^(j/256), 256 / ln 2
_EXP_TAYLOR = (1.0 / 6.0, 0.5, 1.0, 1.0)
# exp underflows to 0 in fp32 below -103.98 and overflows above 88.73; clamping to [-110, 90] keeps
# 2^m a normal double and still gives 0 and inf there (and keeps NaN: clamp passes it through).
_EXP_LO, _EXP_HI = -110.0, 90.0
# log(m) = 2 atanh(f), f = (m - 1) / (m + 1), |f| <= 0.1716 for m in [sqrt(1/2), sqrt(2)):
# 2 f sum_k f^2k / (2k + 1) to k = 9 leaves f^20 / 21 < 2^-56 relative.
_ATANH_TERMS = tuple(1.0 / (2 * k + 1) for k in range(9, -1, -1))
_SQRT_HALF = math.sqrt(0.5)
_CHUNK = 1 << 17  # elements per float64 pass: the temporaries stay in the cache (64K: 12 % slower)


def exp_(x: torch.Tensor) -> torch.Tensor:
    """exp(x) written into x (contiguous fp32), chunk by chunk in float64 buffers; returns x."""
    flat = x.view(-1)
    size = min(_CHUNK, flat.numel())
    table = torch.tensor(_EXP_TABLE, dtype=torch.float64)
    a, r, p, t = (torch.empty(size, dtype=torch.float64) for _ in range(4))
    k, j = (torch.empty(size, dtype=torch.int64) for _ in range(2))
    for start in range(0, flat.numel(), _CHUNK):
        part = flat[start:start + _CHUNK]
        n = part.numel()
        a_, r_, p_, t_, k_, j_ = a[:n], r[:n], p[:n], t[:n], k[:n], j[:n]
        a_.copy_(part).clamp_(_EXP_LO, _EXP_HI)
        kf = round_half_even(a_ * _INV_LN2_STEP)                             # k as float64
        torch.mul(kf, _LN2_HI / (1 << _TABLE_BITS), out=r_)
        torch.sub(a_, r_, out=r_)
        torch.mul(kf, _LN2_LO / (1 << _TABLE_BITS), out=t_)
        r_.sub_(t_)                                                          # r = x - k ln2 / 256
        p_.fill_(_EXP_TAYLOR[0])
        for c in _EXP_TAYLOR[1:]:
            p_.mul_(r_).add_(c)                                              # exp(r), Horner
        k_.copy_(kf)
        torch.bitwise_and(k_, (1 << _TABLE_BITS) - 1, out=j_)
        torch.index_select(table, 0, j_, out=t_)
        p_.mul_(t_)                                                          # * 2^(j/256)
        k_.bitwise_right_shift_(_TABLE_BITS).add_(1023).bitwise_left_shift_(52)
        part.copy_(p_.mul_(k_.view(torch.float64)))                          # * 2^m, one rounding to fp32
    return x


def exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for fp32 x, the same bits on every CPU: float64 table reduction, cubic, one rounding.

    Correctly rounded on 10^6 normal samples (torch.exp misrounds 1.1 % of them); about 5x
    torch.exp's time (12.6M values: 0.09 s vs 0.017 s, 2 cores).
    """
    return exp_(x.to(torch.float32, copy=True).contiguous())


def _log64(u: torch.Tensor) -> torch.Tensor:
    """Natural log of positive, finite, normal float64 u (float64, about 2^-52 relative error)."""
    bits = u.view(torch.int64)
    e = (bits >> 52) - 1023
    m = ((bits & ((1 << 52) - 1)) | (1023 << 52)).view(torch.float64)   # u = m * 2^e, m in [1, 2)
    big = m > 2 * _SQRT_HALF
    m = torch.where(big, m * 0.5, m)                                     # m in [sqrt(1/2), sqrt(2))
    e = (e + big.to(torch.int64)).to(torch.float64)
    f = (m - 1.0) / (m + 1.0)
    s = f * f
    p = torch.full_like(s, _ATANH_TERMS[0])
    for c in _ATANH_TERMS[1:]:
        p.mul_(s).add_(c)
    return (e * _LN2_HI + (f * 2.0) * p) + e * _LN2_LO


def log1p(y: torch.Tensor) -> torch.Tensor:
    """log(1 + y) for fp32 y >= 0 (softplus feeds it exp(x)), the same bits on every CPU.

    1 + y is rounded in float64; log1p(y) = log(u) * (y / (u - 1)) corrects that rounding
    (Goldberg, "What every computer scientist should know about floating-point", Theorem 4),
    and u == 1 means y is below 2^-53, where log1p(y) = y. inf gives inf, NaN gives NaN.
    """
    out = torch.empty_like(y, dtype=torch.float32).contiguous()
    flat_out = out.view(-1)
    flat_in = y.to(torch.float32).contiguous().view(-1)
    for start in range(0, flat_in.numel(), _CHUNK):
        yd = flat_in[start:start + _CHUNK].to(torch.float64)
        finite = torch.isfinite(yd)
        u = torch.where(finite, yd + 1.0, 2.0)
        res = _log64(u) * (yd / (u - 1.0))
        res = torch.where(u == 1.0, yd, res)
        flat_out[start:start + _CHUNK] = torch.where(finite, res, yd)
    return out


def log(x: torch.Tensor) -> torch.Tensor:
    """Natural log of fp32 x > 0 (finite, normal), the same bits on every CPU: float64 ``_log64``, one rounding.

    Triton's softplus ``log(exp(x) + 1)`` (the decode step's state update) takes the log of an fp32 sum.
    """
    return _log64(x.to(torch.float64)).to(torch.float32)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)) in fp32 (three fp32 roundings after ``exp``)."""
    return 1.0 / (exp(-x) + 1.0)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x / (1 + exp(-x)) in fp32: SiLU as the conv kernel and ATen write it."""
    return x / (exp(-x) + 1.0)


def softplus(x: torch.Tensor, threshold: float = 20.0) -> torch.Tensor:
    """log1p(exp(x)) for x <= threshold, x above (F.softplus' and the scan kernel's rule)."""
    return torch.where(x <= threshold, log1p(exp(x.clamp(max=threshold))), x)


def sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root of fp32 x >= 0, the same bits on every CPU.

    torch.sqrt may be one unit in the last place off (MKL's paths differ); the result is fixed
    by exact float64 tests against the midpoints between neighbouring fp32 values: a midpoint
    has at most 25 significant bits, so its square is exact in float64, and a tie cannot occur.
    """
    x = x.to(torch.float32)
    s = torch.sqrt(x)
    lo, hi = torch.nextafter(s, torch.zeros_like(s)), torch.nextafter(s, torch.full_like(s, math.inf))
    xd, sd = x.to(torch.float64), s.to(torch.float64)
    mid_lo = (lo.to(torch.float64) + sd) * 0.5
    mid_hi = (sd + hi.to(torch.float64)) * 0.5
    fixed = torch.where(xd < mid_lo * mid_lo, lo, torch.where(xd > mid_hi * mid_hi, hi, s))
    return torch.where(torch.isfinite(s) & (s > 0), fixed, s)


def sum_last(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim in a fixed pairwise order (keepdim), the same bits on every CPU.

    torch.sum's order follows its vector width; here the last dim is padded with -0.0 (which
    changes no sum) to a power of two and halved: x[..., :h] + x[..., h:] until one is left.
    x: (..., n) -> (..., 1), same dtype.
    """
    n = x.shape[-1]
    width = 1 << max(0, (n - 1).bit_length())
    if width != n:
        x = torch.nn.functional.pad(x, (0, width - n), value=-0.0)
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x


def mean_last(x: torch.Tensor) -> torch.Tensor:
    """sum_last(x) / n, one IEEE division. The divisor is a tensor on x's device: CUDA divides by a Python number
    (or a CPU scalar) as a multiply by its fp32 reciprocal, which differs from the division (1/192 is inexact)."""
    return sum_last(x) / torch.tensor(float(x.shape[-1]), dtype=x.dtype, device=x.device)
