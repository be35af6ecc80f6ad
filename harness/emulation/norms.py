"""The weightless RMSNorms some Mamba-1 variants put on x_proj's output parts (dt, B and C) before dt_proj and the
scan: y = x / sqrt(mean(x^2) + eps) over the last dim, no weight (transformers 5.23
models/falcon_mamba/modeling_falcon_mamba.py:46-57, ``FalconMambaWeightlessRMSNorm``: its ``weight`` is a
non-persistent buffer of ones that the torch path never reads; applied at :466-469).

The sum of squares is ``kernels.portable``'s pairwise sum and the square root its correctly rounded one (as the
block's own RMSNorm, emulation.modules.EmuRMSNorm), so the same bits come out on every CPU; transformers'
``x * rsqrt(mean + eps)`` differs from it by a few fp32 ulps.

An int8 output (the W8A8 recipes, whose x_proj output is int8) is re-quantized at ``bound_scale(width)``: a
weightless RMSNorm's output row has sum(y^2) = n * m / (m + eps) < n, so |y_i| < sqrt(n) and the scale
sqrt(n) / 127 never clips and needs no calibration (docs/models.md, "Falcon-Mamba").
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..kernels import portable
from ..kernels.quant import dequantize, to_output
from ..spec import Act, OutSpec

__all__ = ["EmuWeightlessRMSNorm", "EmuMixerNorms", "MIXER_NORM_SITES", "bound_scale"]

# the capture sites of the three norms, in data-flow order (emulation.capture.MIXER_NORM_POINTS describes them)
MIXER_NORM_SITES: tuple[str, ...] = ("dt_norm.out", "b_norm.out", "c_norm.out")


def bound_scale(width: int) -> float:
    """sqrt(width) / 127 as an fp32-representable float, rounded up so that it still bounds every output."""
    s = torch.tensor(math.sqrt(width) / 127.0, dtype=torch.float32)
    if float(s) < math.sqrt(width) / 127.0:
        s = torch.nextafter(s, torch.tensor(math.inf))
    return float(s)


class EmuWeightlessRMSNorm(nn.Module):
    """x (fp32 or a QTensor, dequantized) -> x / sqrt(sum(x^2) / n + eps), then the output rule."""

    def __init__(self, eps: float, out: OutSpec) -> None:
        super().__init__()
        self.eps, self.out = eps, out

    def forward(self, x: Act) -> Act:
        x = dequantize(x).to(torch.float32)
        var = portable.mean_last(x * x)
        return to_output(x * (1.0 / portable.sqrt(var + self.eps)), self.out)


class EmuMixerNorms(nn.Module):
    """The dt, B and C norms of one block."""

    def __init__(self, dt: EmuWeightlessRMSNorm, b: EmuWeightlessRMSNorm, c: EmuWeightlessRMSNorm) -> None:
        super().__init__()
        self.dt, self.b, self.c = dt, b, c
