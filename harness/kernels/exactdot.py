"""Correctly rounded fp32 matrix products: the same bits on every CPU and GPU.

A float GEMM's bits depend on its summation order, which MKL, oneDNN and cuBLAS choose by machine (measured: the
chunked SSD's einsums moved Quamba2's int8 codes between an H200 and its host CPU, docs/gpu.md). ``matmul_rn``
returns, for every output element, the fp32 value nearest the exact sum of the fp32 products (ties to even): a
value that no order can change.

How: the fp32 products are exact in float64, so a float64 GEMM S is within E = 2 K u T of the exact sum (K terms,
u = 2^-53, T = sum |a_k b_k|, in any summation order), with T bounded by the operands' row and column norms.
Where S - E and S + E round to the same fp32 value, that value is the exact sum's. Elsewhere (the exact sum within
E of a midpoint between two fp32 values: about 600 of 3.9 M outputs in a 130m-shaped SSD layer) the exact sum is
taken with ``math.fsum`` (exact, then rounded once to float64) and rounded to fp32, the double-rounding case
decided by the sign of the exact residual.

Shapes: ``a (..., m, k) @ b (..., k, n) -> (..., m, n)`` fp32, batch dimensions broadcast as ``torch.matmul``.
"""
from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["matmul_rn", "matmul_rn_ref", "round_exact_sum"]

_U = 2.0 ** -53          # float64 unit roundoff
_SAFE = 1.01             # margin on every bound
_BLOCK = 1 << 18         # elements of the largest float64 temporary of one block


def round_exact_sum(products: list[float]) -> np.float32:
    """The fp32 value nearest the exact sum of float64 `products` (ties to even)."""
    try:
        f = math.fsum(products)                 # the exact sum rounded once to float64
    except ValueError:                          # inf - inf: NaN in any order
        return np.float32(np.nan)
    r = np.float32(f)
    if not math.isfinite(f) or float(r) == f:
        return r
    lo, hi = (r, np.nextafter(r, np.float32(np.inf))) if float(r) < f else (np.nextafter(r, np.float32(-np.inf)), r)
    mid = (float(lo) + float(hi)) / 2           # exact in float64
    if f != mid:
        return r                                # f is not a midpoint: rounding f rounds the exact sum
    side = math.fsum([*products, -mid])         # the sign of exact - mid, exactly
    if side == 0:
        return r                                # a true tie: numpy rounded it to even
    return hi if side > 0 else lo


def _bound(a64: torch.Tensor, b64: torch.Tensor) -> torch.Tensor:
    """E (float64): the largest distance between a float64 GEMM of a and b (any order) and the exact sum: 2 k u T
    with T = sum_k |a_ik b_kj| <= ||a_i|| ||b_j|| (Cauchy-Schwarz: no second GEMM), the norms in float64 (exact
    squares, k-term sums: inflated by 2 k u), plus 2^-49 T for rounding S -+ E in float64 (T >= |S|)."""
    k = a64.shape[-1]
    c = (1.0 + 4.0 * k * _U) * (2.0 * k * _U + 2.0 ** -49) * _SAFE
    rows = a64.square().sum(-1).sqrt_().mul_(c)                          # (..., m)
    cols = b64.square().sum(-2).sqrt_()                                  # (..., n)
    return rows[..., :, None] * cols[..., None, :]


def _fix_hard(out: torch.Tensor, hard: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """The uncertain elements of `out`, each from the exact sum of its products (on the CPU, in Python)."""
    idx = hard.nonzero().cpu()
    if idx.numel() == 0:
        return
    batch = out.shape[:-2]
    a_cpu = a.expand(*batch, *a.shape[-2:]).cpu().to(torch.float64)
    b_cpu = b.expand(*batch, *b.shape[-2:]).cpu().to(torch.float64)
    values = []
    for pos in idx.tolist():
        *lead, i, j = pos
        prods = (a_cpu[(*lead, i)] * b_cpu[(*lead, slice(None), j)]).tolist()
        values.append(round_exact_sum(prods))
    out[tuple(idx.to(out.device).unbind(1))] = torch.tensor(np.array(values, dtype=np.float32), device=out.device)


def _matmul_rn_block(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """matmul_rn of (N, m, k) @ (N, k, n) into out (N, m, n)."""
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    s = torch.matmul(a64, b64)
    e = _bound(a64, b64)
    lo = (s - e).to(torch.float32)
    out.copy_(s.add_(e))
    _fix_hard(out, lo != out, a, b)


def matmul_rn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with each element the fp32 value nearest the exact sum of the fp32 products a[.., i, k] b[.., k, j].
    Computed over the batch in blocks of about _BLOCK elements, so the float64 temporaries stay small (freshly
    mapped pages are slow on a virtual machine: a 130m SSD layer's whole-tensor temporaries cost 3x the GEMMs)."""
    a, b = a.to(torch.float32), b.to(torch.float32)
    shape = np.broadcast_shapes(tuple(a.shape[:-2]), tuple(b.shape[:-2]))  # torch.broadcast_shapes imports sympy
    (m, k), n = a.shape[-2:], b.shape[-1]
    a3 = a.expand(*shape, m, k).reshape(-1, m, k)
    b3 = b.expand(*shape, k, n).reshape(-1, k, n)
    out = torch.empty(a3.shape[0], m, n, dtype=torch.float32)
    step = max(1, _BLOCK // (m * max(k, n)))
    for i in range(0, a3.shape[0], step):
        _matmul_rn_block(a3[i:i + step], b3[i:i + step], out[i:i + step])
    return out.reshape(*shape, m, n)


def matmul_rn_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """matmul_rn element by element from the exact sums (the oracle; small tensors only)."""
    a, b = a.to(torch.float32), b.to(torch.float32)
    shape = np.broadcast_shapes(tuple(a.shape[:-2]), tuple(b.shape[:-2]))  # torch.broadcast_shapes imports sympy
    out = torch.empty(*shape, a.shape[-2], b.shape[-1], dtype=torch.float32)
    _fix_hard(out, torch.ones(out.shape, dtype=torch.bool), a.expand(*shape, *a.shape[-2:]),
              b.expand(*shape, *b.shape[-2:]))
    return out
