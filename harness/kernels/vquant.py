"""The virtual-INT8 quantizers of the research fork 798253405/Quamba-SE (modes 4, 5-x, 6-x): fp32 tensors whose
values lie on one or more integer grids, with the fork's own division and rounding.

Notation (docs/se-modes.md; the fork at f4d350a unless marked): ``s`` is conv1d.output_scale, a Python float
(quamba/qMambaLayer.py:1094-1097). Every quantizer returns ``Segmented(u, seg, names)``: u the fp32 values, seg
the index into ``names`` of the segment each element fell in (segment diagnostics).

* Division by a Python-float scale (``x / s`` on a CUDA tensor) is a multiply by the fp32 reciprocal,
  ``x * fl32(1 / fl32(s))`` (PyTorch aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu, CPU-scalar divisor):
  ``div="recip"``, the default. ``div="exact"`` is IEEE ``x / fl32(s)`` (what the same code computes on a CPU).
  Divisions by a 0-dim *tensor* (5-3's dynamic outlier scale) are exact on both.
* Rounding: ``rna`` is the fork's ``roundf_like`` (qMambaLayer.py:1433-1435): ``where(v >= 0, floor(v + 0.5),
  ceil(v - 0.5))`` with ``v + 0.5`` rounded to fp32 first (so 0.49999997 -> 1, unlike C roundf); ``rne`` is
  ``torch.round`` (ties to even). The 5-x modes use rna, mode 4 and the 6-x modes rne.
* Comparisons with a Python-float threshold compare against ``fl32(threshold)`` (the scalar takes the tensor's
  dtype); sums with a Python-float offset add ``fl32(offset)`` in fp32.

The ``*_ref`` twins (kernels.vquant_ref) compute the same element by element with numpy fp32 scalars.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..spec import QTensor
from .rounding import round_half_away_fp32, round_half_even

__all__ = ["Segmented", "DIVISIONS", "ROUNDINGS", "f32s", "div_scalar", "round_fork", "round_code", "vq_grid",
           "vq_outlier", "dynamic_outlier_scale", "vq_dual", "vq_fine", "vq_quarter_log2", "vq_three_segment",
           "xproj_codes", "striped_u", "segment_sums", "segment_shares", "kernel_tile"]

DIVISIONS = ("recip", "exact")
ROUNDINGS = ("rna", "rne")
_F32 = torch.float32


class Segmented(NamedTuple):
    """u: the quantized fp32 values; seg: (same shape) int64 index into names; names: the segments."""

    u: torch.Tensor
    seg: torch.Tensor
    names: tuple[str, ...]


def f32s(v: float) -> torch.Tensor:
    """A Python float as the fp32 0-dim tensor a CUDA op turns it into."""
    return torch.tensor(v, dtype=_F32)


def div_scalar(x: torch.Tensor, s: float, div: str = "recip") -> torch.Tensor:
    """x / s for a Python-float s: x * fl32(1 / fl32(s)) ("recip", CUDA) or x / fl32(s) ("exact")."""
    if div == "recip":
        return x.to(_F32) * (f32s(1.0) / f32s(s))
    if div == "exact":
        return x.to(_F32) / f32s(s)
    raise ValueError(f"unknown division {div!r}; valid: {', '.join(DIVISIONS)}")


def round_fork(v: torch.Tensor) -> torch.Tensor:
    """The fork's roundf_like in fp32: where(v >= 0, floor(v + 0.5), ceil(v - 0.5)) (qMambaLayer.py:1433-1435)."""
    return round_half_away_fp32(v)


def round_code(v: torch.Tensor, rounding: str) -> torch.Tensor:
    """rna: round_fork; rne: torch.round (half to even)."""
    if rounding == "rna":
        return round_fork(v)
    if rounding == "rne":
        return round_half_even(v.to(_F32))
    raise ValueError(f"unknown rounding {rounding!r}; valid: {', '.join(ROUNDINGS)}")


def _grid(q: torch.Tensor, s: float, lo: float = -128, hi: float = 127) -> torch.Tensor:
    return q.clamp(lo, hi) * f32s(s)


def vq_grid(x: torch.Tensor, s: float, rounding: str, div: str = "recip") -> Segmented:
    """5-0 / 6-0 (qMambaLayer.py:1437-1439, :2363): u = clamp(R(x/s), -128, 127) * s; "clipped" where R(x/s)
    was outside [-128, 127]."""
    q = round_code(div_scalar(x, s, div), rounding)
    clipped = (q > 127) | (q < -128)
    return Segmented(_grid(q, s), clipped.long(), ("grid", "clipped"))


def vq_outlier(x: torch.Tensor, s: float, rounding: str, div: str = "recip") -> Segmented:
    """5-2 (:1695-1701), 6-2 (:2533-2536), mode 4 (qConvLayer.py:131-138): the s-grid, except |R(x/s)| > 127
    (q = -128 included) keeps x itself."""
    q = round_code(div_scalar(x, s, div), rounding)
    out = q.abs() > 127
    return Segmented(torch.where(out, x.to(_F32), _grid(q, s)), out.long(), ("grid", "outlier"))


def dynamic_outlier_scale(x: torch.Tensor, s: float, rounding: str, div: str = "recip") -> torch.Tensor:
    """5-3's outlier scale (qMambaLayer.py:1780-1788): max|x| over |R(x/s)| > 127, divided by the Python float
    127.0 (a reciprocal multiply under "recip"), floored at s; s when there is no outlier. A 0-dim fp32 tensor."""
    q = round_code(div_scalar(x, s, div), rounding)
    out = q.abs() > 127
    if not bool(out.any()):
        return f32s(s)
    return div_scalar(x.to(_F32)[out].abs().max(), 127.0, div).clamp(min=f32s(s))


def vq_dual(x: torch.Tensor, s: float, os: float | torch.Tensor, rounding: str, div: str = "recip") -> Segmented:
    """5-3 (:1791-1800) and 6-4 (:2766-2780): normals on the s-grid, outliers (|R(x/s)| > 127) on the os-grid,
    clamp(R(x/os), -128, 127) * os. A tensor os (5-3) divides exactly, a Python float (6-4) by `div`."""
    q = round_code(div_scalar(x, s, div), rounding)
    out = q.abs() > 127
    if isinstance(os, torch.Tensor):
        qo, os_t = round_code(x.to(_F32) / os.to(_F32), rounding), os.to(_F32)
    else:
        qo, os_t = round_code(div_scalar(x, os, div), rounding), f32s(os)
    return Segmented(torch.where(out, qo.clamp(-128, 127) * os_t, _grid(q, s)), out.long(), ("normal", "outlier"))


def vq_fine(x: torch.Tensor, s: float, factor: int, limit: int, rounding: str, div: str = "recip") -> Segmented:
    """5-4 (factor 4, limit 32, :1880-1892) and 6-3 (factor 2, limit 64, :2616-2634): |R(x/s)| < limit on the
    s/factor grid (codes clamped to +-127), the rest on the s-grid, clipped ("clipped" where |R(x/s)| passed it)."""
    fine = s / factor  # a Python float, exact (s is an fp32 value)
    q = round_code(div_scalar(x, s, div), rounding)
    small = q.abs() < limit
    u = torch.where(small, _grid(round_code(div_scalar(x, fine, div), rounding), fine, -127, 127), _grid(q, s))
    seg = torch.where(small, 0, torch.where((q > 127) | (q < -128), 2, 1))
    return Segmented(u, seg, ("small", "normal", "clipped"))


def vq_quarter_log2(x: torch.Tensor, s: float, div: str = "recip") -> Segmented:
    """5-6 (qMambaLayer.py:2025-2048): |x| <= 8s on the s/4 grid (rna); above, sign(x) * (8s + 2^k * s/4) with
    k = clamp(floor(log2(max(|x| - 8s, s/4) / (s/4))), 0, 255), a floor (no rounding to the nearest level)."""
    qs = s / 4.0
    m = 32 * qs
    xf = x.to(_F32)
    ax = xf.abs()
    small = ax <= f32s(m)
    x_small = _grid(round_fork(div_scalar(xf, qs, div)), qs, -127, 127)
    r = (ax - f32s(m)).clamp(min=f32s(qs))
    k = torch.floor(torch.log2(div_scalar(r, qs, div))).clamp(0, 255)
    x_log = torch.sign(xf) * (f32s(m) + torch.pow(f32s(2.0), k) * f32s(qs))
    return Segmented(torch.where(small, x_small, x_log), (~small).long(), ("small", "log2"))


def vq_three_segment(x: torch.Tensor, s: float, div: str = "recip") -> Segmented:
    """5-7 (qMambaLayer.py:2199-2232): high |x| <= 15.75s on the s/4 grid (codes +-63); mid |x| <= 143s:
    sign * clamp(R(|x|/s), 16, 143) * s; low: sign * (143s + clamp(R((|x| - 143s) / 4s), 0, 63) * 4s), at most
    395s. All rna. 509 distinct values (9 bits), not the docstring's 253."""
    hs, ls = s / 4.0, s * 4.0
    hm, mm = 63 * hs, 143 * s
    xf = x.to(_F32)
    ax, sg = xf.abs(), torch.sign(xf)
    high = ax <= f32s(hm)
    mid = (ax > f32s(hm)) & (ax <= f32s(mm))
    x_high = _grid(round_fork(div_scalar(xf, hs, div)), hs, -63, 63)
    x_mid = sg * round_fork(div_scalar(ax, s, div)).clamp(16, 143) * f32s(s)
    q_low = round_fork(div_scalar(ax - f32s(mm), ls, div)).clamp(0, 63)
    x_low = sg * (f32s(mm) + q_low * f32s(ls))
    seg = torch.where(high, 0, torch.where(mid, 1, 2))
    return Segmented(torch.where(high, x_high, torch.where(mid, x_mid, x_low)), seg, ("high", "mid", "low"))


def xproj_codes(v: torch.Tensor, s: float, rounding: str, div: str = "recip") -> QTensor:
    """x_proj's int8 input: clamp(R(v/s), -128, 127).to(int8) (5-x: :1443, :1567, :1708, :1895, :2051, :2236;
    mode 4 and 6: RNE, :1170-1187, :2990), with how many codes saturated."""
    q = round_code(div_scalar(v, s, div), rounding)
    n_clipped = int(((q > 127) | (q < -128)).sum())
    return QTensor(q.clamp(-128, 127).to(torch.int8), s, n_clipped)


def kernel_tile(seqlen: int) -> tuple[int, int] | None:
    """(kNThreads, kNItems) of fwd_mode5/6 when its fp32-u loader reads striped (kDirectIO), else None: the
    dispatcher's (32, 4) for L <= 128 and (32, 8) for L <= 256 (quant_sscan_fwd_kernel.cuh:606-619), with
    kIsEvenLen (seqlen % (kNThreads * kNItems) == 0, :586) and one load (kNElts = min(8, kNItems), :34, :43)."""
    for limit, threads, items in ((128, 32, 4), (256, 32, 8)):
        if seqlen <= limit:
            return (threads, items) if seqlen % (threads * items) == 0 and items <= 8 else None
    return None


def striped_u(u: torch.Tensor) -> torch.Tensor:
    """u as the fwd_mode5/6 kernel would pair it with delta/B/C when it loads u striped and the rest blocked
    (load_input_fp32_direct, quant_sscan_fwd_kernel.cuh:346-360; unverified on a GPU): within each chunk of
    kNThreads * kNItems tokens, item i of thread t is u[t + i * kNThreads] instead of u[t * kNItems + i].
    u: (batch, seqlen, d); lengths without striped loads are returned unchanged."""
    tile = kernel_tile(u.shape[1])
    if tile is None:
        return u
    threads, items = tile
    pos = torch.arange(u.shape[1])
    t, i = pos // items, pos % items  # blocked position -> (thread, item)
    return u[:, t + i * threads]


def segment_sums(x: torch.Tensor, v: Segmented) -> tuple[list[int], list[float]]:
    """Per segment of v: how many elements fell in it, and the sum of their squared errors (u - x)^2 (float64)."""
    err = (v.u.to(torch.float64) - x.to(torch.float64)) ** 2
    seg = v.seg.flatten()
    counts = torch.bincount(seg, minlength=len(v.names))
    sq = torch.zeros(len(v.names), dtype=torch.float64).index_add_(0, seg, err.flatten())
    return [int(c) for c in counts.tolist()], sq.tolist()


def segment_shares(x: torch.Tensor, v: Segmented) -> dict[str, dict[str, float]]:
    """Per segment: the fraction of elements in it and its share of the total squared error sum((u - x)^2)
    (0 when the error is 0 everywhere)."""
    counts, sq = segment_sums(x, v)
    n, total = sum(counts), sum(sq)
    return {name: {"fraction": counts[k] / n if n else 0.0, "error_share": sq[k] / total if total > 0 else 0.0}
            for k, name in enumerate(v.names)}
