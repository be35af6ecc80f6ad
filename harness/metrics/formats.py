"""The error of representing one tensor in a number format (harness.kernels.formats), for the format sweep.

For x (a captured float32 tensor) and y = fake_quantize(x, fmt), over the finite elements of x, in float64:

    mse, rel_l2 = ||y - x|| / ||x||, sqnr_db = 10 log10(sum x^2 / sum (y - x)^2), max_abs = max |y - x|
    overflow    fraction of finite x whose y is +-inf or NaN (the casts and hifp8 past their largest value)
    underflow   fraction of nonzero x whose y is 0 (flushed below the format's smallest step)
    saturated   fraction of finite y whose |x| exceeds the largest magnitude its scale group represents
                (the clamp acted: MX's floor scale, an NVFP4 scale rounded down, int4's +7s side)
    outlier_blocks  (formats with a block size) fraction of scale groups whose largest |x| is at least twice
                the second largest: one element set the group's scale, at least one binade above the rest

A y - x that overflows makes mse, max_abs infinite and sqnr -inf; an x with no finite element gives NaN mse,
sqnr and max_abs, rel_l2 0 and no element counted as overflowing, flushed or saturated. Tensors whose last dimension does not fit a format's block are reported as not applicable, and so are empty
tensors (a dimension of size 0: nothing to represent; ``empty_tensor``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..kernels.formats import FORMATS, check_shape, fake_quantize_with_limit, scale_groups

__all__ = ["FORMAT_METRICS", "format_errors", "not_applicable", "empty_tensor", "reference", "Reference"]

FORMAT_METRICS = ("mse", "rel_l2", "sqnr_db", "max_abs", "overflow", "underflow", "saturated", "outlier_blocks")
OUTLIER_RATIO = 2.0


def empty_tensor(x_shape: tuple[int, ...]) -> str | None:
    """Why a tensor of this shape has no values to represent (a dimension of size 0), else None."""
    return f"the tensor is empty (shape {list(x_shape)}): it holds no values to represent" if 0 in x_shape else None


def not_applicable(x_shape: tuple[int, ...], fmt: str) -> str | None:
    """Why `fmt` cannot represent a tensor of this shape (empty, or its last dim is not a multiple of the
    block), else None."""
    if (empty := empty_tensor(x_shape)) is not None:
        return empty
    try:
        check_shape(torch.empty(x_shape[-1:] if x_shape else ()), fmt)
    except ValueError as e:
        return str(e)
    return None


def _fraction(count: int, total: int) -> float:
    return count / total if total else 0.0


def _sqnr_db(signal: float, noise: float) -> float:
    if noise == 0:
        return math.inf
    ratio = signal / noise
    return 10 * math.log10(ratio) if ratio > 0 else -math.inf


def _outlier_blocks(x: torch.Tensor, block: int) -> float | None:
    if not block:
        return None
    top2 = scale_groups(x.abs(), block).topk(2, dim=-1).values
    finite = torch.isfinite(top2).all(-1)
    outlier = (top2[..., 0] >= OUTLIER_RATIO * top2[..., 1]) & (top2[..., 0] > 0) & finite
    return _fraction(int(outlier.sum()), int(finite.numel()))


@dataclass
class Reference:
    """What the metrics need of x alone, computed once for every format a tensor is swept in."""

    x: torch.Tensor                 # float32
    finite: torch.Tensor | None     # mask of x's finite elements; None when all are finite
    xf: torch.Tensor                # the finite elements, float64, 1-D (in x's order)
    n: int                          # their count
    nonzero: int                    # finite elements that are not 0
    signal: float                   # sum of xf^2
    outliers: dict[int, float | None] = field(default_factory=dict)  # block size -> outlier_blocks

    def outlier_blocks(self, block: int) -> float | None:
        if block not in self.outliers:
            self.outliers[block] = _outlier_blocks(self.x, block)
        return self.outliers[block]


def reference(x: torch.Tensor) -> Reference:
    x = x.to(torch.float32)
    finite = torch.isfinite(x)
    if bool(finite.all()):
        xf, finite = x.reshape(-1).double(), None   # the same elements in the same order as x[finite]
        nonzero = int((x != 0).sum())
    else:
        xf = x[finite].double()
        nonzero = int(((x != 0) & finite).sum())
    return Reference(x, finite, xf, int(xf.numel()), nonzero, float((xf * xf).sum()))


def format_errors(x: torch.Tensor, fmt: str, ref: Reference | None = None) -> dict[str, float | None]:
    """The metrics of the module docstring for x (any rank >= 1, float32) in format `fmt`; `ref`: x's
    ``reference`` when the caller sweeps it in several formats (the same numbers, computed once)."""
    ref = reference(x) if ref is None else ref
    x, n = ref.x, ref.n
    y, limit = fake_quantize_with_limit(x, fmt)
    yf = (y.reshape(-1) if ref.finite is None else y[ref.finite]).double()
    d = yf - ref.xf
    noise, signal = float((d * d).sum()), ref.signal
    y_finite = torch.isfinite(y)
    keep = y_finite if ref.finite is None else y_finite & ref.finite
    lost = ~y_finite if ref.finite is None else ~y_finite & ref.finite
    flushed = (y == 0) & (x != 0) if ref.finite is None else (y == 0) & (x != 0) & ref.finite
    return {
        "mse": noise / n if n else math.nan,
        "rel_l2": math.sqrt(noise / signal) if signal else (0.0 if noise == 0 else math.nan),
        "sqnr_db": _sqnr_db(signal, noise) if n else math.nan,
        "max_abs": float(d.abs().max()) if n else math.nan,
        "overflow": _fraction(int(lost.sum()), n),
        "underflow": _fraction(int(flushed.sum()), ref.nonzero),
        "saturated": _fraction(int((keep & (x.abs() > limit) & (limit > 0)).sum()), n),
        "outlier_blocks": ref.outlier_blocks(FORMATS[fmt].block),
    }
