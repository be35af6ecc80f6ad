"""Calibration observers of the Quamba1 recipe (observer.py:35-183, spec notes §2.3).

Two phases: ``observe(x)`` folds a batch of samples into running statistics,
``compute_scale()`` turns them into a per-tensor symmetric scale through
``kernels.quant`` (no second formula here). Both observe the fp16 values the
calibration model stores; x arrives as fp32 holding those values.

* ``MinMaxObserver``: w = max over samples of max|a| (fp16); scale = w / 127 in fp16.
  The max over a batch equals the max of the per-sample maxima, so batching
  changes nothing.
* ``PercentileObserver``: per sample, cur = quantile(|a|, alpha) with linear
  interpolation (torch.quantile's rule, reproduced bit-exactly from the top
  values only); w = cur for the first sample, then w <- w + 0.01 * (cur - w) in
  fp32, samples taken in order; scale = w / 127 in fp32. A batch is split into
  its samples along dim 0, so batched and one-by-one calibration agree.
"""
from __future__ import annotations

import torch

from ...kernels.quant import minmax_scale_fp16, scale_from_amax_fp32

__all__ = ["MinMaxObserver", "PercentileObserver", "quantile_high"]

_EMA_SIGMA = 0.01  # percentile_sigma in observer.py


def quantile_high(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """torch.quantile(row, alpha) for each row of x, using only the top values of each row.

    x: (rows, n) fp32 -> (rows,) fp32. Like torch.quantile: rank = alpha * (n - 1) in
    fp32, below = floor(rank), weight = rank - below, lerp(v[below], v[below + 1], weight)
    over the ascending sort, so the result is bit-identical to it. For alpha near 1
    only the (n - below) largest values are needed, which `topk` finds without a sort.
    """
    n = x.shape[-1]
    rank = torch.tensor(alpha, dtype=torch.float32) * (n - 1)
    below = int(torch.floor(rank))
    above = min(below + 1, n - 1) if float(rank) > below else below
    weight = rank - below
    k = n - below  # positions below..n-1 of the ascending order are the k largest
    top = torch.topk(x, k, dim=-1, largest=True, sorted=True).values  # descending
    v_below = top[:, k - 1]
    v_above = top[:, n - 1 - above]
    return torch.lerp(v_below, v_above, weight)


class MinMaxObserver:
    """Running max|a| in fp16, floored at 1e-5 per sample."""

    def __init__(self) -> None:
        self.amax: torch.Tensor | None = None
        self.samples = 0

    def observe(self, x: torch.Tensor) -> None:
        """x: (batch, ...) fp32 holding fp16 values (any float is rounded to fp16 first)."""
        cur = x.detach().to(torch.float16).abs().amax().clamp(min=1e-5)
        self.amax = cur if self.amax is None else torch.maximum(self.amax, cur)
        self.samples += x.shape[0]

    def compute_scale(self) -> float:
        if self.amax is None:
            raise RuntimeError("MinMaxObserver has seen no data; run the calibration forward before computing scales")
        return minmax_scale_fp16(self.amax)

    def state(self) -> dict[str, float]:
        return {"amax": float(self.amax) if self.amax is not None else float("nan"), "samples": self.samples}


class PercentileObserver:
    """EMA of the per-sample alpha-quantile of |a|."""

    def __init__(self, alpha: float) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"percentile alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.ema: torch.Tensor | None = None
        self.raw_max = 0.0
        self.samples = 0

    def observe(self, x: torch.Tensor) -> None:
        """x: (batch, ...) fp32 holding fp16 values; each sample along dim 0 is one update."""
        rows = x.detach().to(torch.float16).to(torch.float32).abs().reshape(x.shape[0], -1)
        cur = quantile_high(rows, self.alpha)
        for value in cur:
            self.ema = value.clone() if self.ema is None else self.ema + _EMA_SIGMA * (value - self.ema)
        self.raw_max = max(self.raw_max, float(rows.max()))
        self.samples += x.shape[0]

    def compute_scale(self) -> float:
        if self.ema is None:
            raise RuntimeError("PercentileObserver has seen no data; run the calibration forward before computing scales")
        return scale_from_amax_fp32(self.ema)

    def state(self) -> dict[str, float]:
        return {"ema_quantile": float(self.ema) if self.ema is not None else float("nan"),
                "raw_max": self.raw_max, "alpha": self.alpha, "samples": self.samples}
