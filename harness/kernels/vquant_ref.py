"""Written-out twins of kernels.vquant: each of the fork's virtual-INT8 quantizers element by element, in numpy
fp32 scalars (every operation rounds to fp32 as the CUDA op does), without torch. The tests hold the kernels to
these on crafted tensors at every segment edge (tests/kernels/test_vquant.py)."""
from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["div_scalar_ref", "round_fork_ref", "round_code_ref", "vq_grid_ref", "vq_outlier_ref", "vq_dual_ref",
           "vq_fine_ref", "vq_quarter_log2_ref", "vq_three_segment_ref", "xproj_codes_ref", "striped_u_ref"]

F = np.float32


def _each(x: torch.Tensor, fn) -> torch.Tensor:
    flat = [fn(F(v)) for v in x.to(torch.float32).flatten().tolist()]
    return torch.tensor(np.array(flat, dtype=np.float32)).reshape(x.shape)


def div_scalar_ref(v: np.float32, s: float, div: str = "recip") -> np.float32:
    """v * (1/s) with the reciprocal rounded to fp32, or v / s, both in fp32."""
    return F(v) * (F(1.0) / F(s)) if div == "recip" else F(v) / F(s)


def round_fork_ref(v: np.float32) -> np.float32:
    """floor(v + 0.5) for v >= 0, else ceil(v - 0.5), the sum rounded to fp32 first."""
    v = F(v)
    return F(math.floor(F(v + F(0.5)))) if v >= 0 else F(math.ceil(F(v - F(0.5))))


def round_code_ref(v: np.float32, rounding: str) -> np.float32:
    if rounding == "rna":
        return round_fork_ref(v)
    lo = math.floor(v)
    frac = float(v) - lo
    if frac != 0.5:
        return F(lo + (1 if frac > 0.5 else 0))
    return F(lo if lo % 2 == 0 else lo + 1)


def _clamp(q, lo, hi):
    return F(min(max(q, lo), hi))


def _q(v, s, rounding, div):
    return round_code_ref(div_scalar_ref(v, s, div), rounding)


def vq_grid_ref(x: torch.Tensor, s: float, rounding: str, div: str = "recip") -> torch.Tensor:
    return _each(x, lambda v: F(_clamp(_q(v, s, rounding, div), -128, 127) * F(s)))


def vq_outlier_ref(x: torch.Tensor, s: float, rounding: str, div: str = "recip") -> torch.Tensor:
    def one(v):
        q = _q(v, s, rounding, div)
        return v if abs(q) > 127 else F(_clamp(q, -128, 127) * F(s))
    return _each(x, one)


def vq_dual_ref(x: torch.Tensor, s: float, os: float, rounding: str, div: str = "recip",
                os_exact: bool = False) -> torch.Tensor:
    def one(v):
        q = _q(v, s, rounding, div)
        if abs(q) <= 127:
            return F(_clamp(q, -128, 127) * F(s))
        qo = round_code_ref(F(v) / F(os), rounding) if os_exact else _q(v, os, rounding, div)
        return F(_clamp(qo, -128, 127) * F(os))
    return _each(x, one)


def vq_fine_ref(x: torch.Tensor, s: float, factor: int, limit: int, rounding: str, div: str = "recip") -> torch.Tensor:
    fine = s / factor

    def one(v):
        q = _q(v, s, rounding, div)
        if abs(q) < limit:
            return F(_clamp(_q(v, fine, rounding, div), -127, 127) * F(fine))
        return F(_clamp(q, -128, 127) * F(s))
    return _each(x, one)


def vq_quarter_log2_ref(x: torch.Tensor, s: float, div: str = "recip") -> torch.Tensor:
    qs = s / 4.0
    m = F(8 * s)

    def one(v):
        if abs(v) <= m:
            return F(_clamp(_q(v, qs, "rna", div), -127, 127) * F(qs))
        r = max(F(abs(v) - m), F(qs))
        k = _clamp(math.floor(F(math.log2(div_scalar_ref(r, qs, div)))), 0, 255)  # log2 rounded to fp32
        return F(F(math.copysign(1.0, v)) * F(m + F(F(2.0 ** int(k)) * F(qs))))
    return _each(x, one)


def vq_three_segment_ref(x: torch.Tensor, s: float, div: str = "recip") -> torch.Tensor:
    hs, ls = s / 4.0, 4.0 * s
    hm, mm = F(63 * hs), F(143 * s)

    def one(v):
        a, sg = F(abs(v)), F(0.0 if v == 0 else math.copysign(1.0, v))
        if a <= hm:
            return F(_clamp(_q(v, hs, "rna", div), -63, 63) * F(hs))
        if a <= mm:
            return F(F(sg * _clamp(_q(a, s, "rna", div), 16, 143)) * F(s))
        return F(sg * F(mm + F(_clamp(_q(F(a - mm), ls, "rna", div), 0, 63) * F(ls))))
    return _each(x, one)


def xproj_codes_ref(v: torch.Tensor, s: float, rounding: str, div: str = "recip") -> torch.Tensor:
    return _each(v, lambda e: _clamp(_q(e, s, rounding, div), -128, 127)).to(torch.int8)


def striped_u_ref(u: torch.Tensor, threads: int, items: int) -> torch.Tensor:
    """Thread t's item i (blocked position t * items + i) reads u[t + i * threads]: written as the loops."""
    out = torch.empty_like(u)
    for t in range(threads):
        for i in range(items):
            out[:, t * items + i] = u[:, t + i * threads]
    return out
