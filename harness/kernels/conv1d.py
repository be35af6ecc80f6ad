"""Causal depthwise conv1d + SiLU: the Quamba int8 kernel and the floating-point conv.

Int8 kernel (quant_causal_conv1d_fwd_kernel.cuh:80-151, spec notes §2.6 step 3), for
each (batch, channel d, token t):

    acc = sum_k Wq[d, k] * xq[t - (d_conv - 1) + k]      exact integer, zero history
    v   = fma(f32(s_w * s_x), acc, f32(bq[d]) * s_b)     one fp32 FMA
    v   = v / (1 + exp(-v))                              SiLU in fp32
    out = sat8(RNA(v / s_u))  or  v itself (the "true fp32 conv" of modes 2-3, 2-4, 3)

Both outputs come from the same v, so a true-fp32 conv differs from the int8
conv only by the final rounding. The GPU kernel uses `__expf` (fast math); this
emulation uses the correctly rounded fp32 `exp` of ``portable`` (the same bits on every
CPU), so rare values can land one code apart.

The floating-point conv sums its taps in a fixed order, one rounding per product and per sum
(bias first, then tap 0 .. d_conv-1, the loop order of mamba's causal_conv1d kernel, which
contracts each step into an FMA on the GPU), instead of F.conv1d, whose order and FMA use
follow the CPU's oneDNN/ATen code path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..spec import OutSpec, QTensor
from .portable import exp, sigmoid
from .quant import dequantize, f32, fma_f32, round_to_dtype, to_output

__all__ = ["silu_kernel", "int8_causal_conv1d_silu", "float_causal_conv1d_silu", "causal_conv1d_silu_ref",
           "dequantized_conv1d_silu"]


def silu_kernel(v: torch.Tensor) -> torch.Tensor:
    """SiLU as the conv kernel writes it: v / (1 + exp(-v)), in fp32 (portable exp)."""
    return v / (exp(-v) + 1.0)


def _shifted(x: torch.Tensor, shift: int) -> torch.Tensor:
    """x delayed by `shift` tokens along seqlen (dim 1) with zeros in front; x: (batch, seqlen, d)."""
    if shift == 0:
        return x
    return F.pad(x, (0, 0, shift, 0))[:, : x.shape[1]]


def int8_causal_conv1d_silu(x: QTensor, weight: QTensor, bias: QTensor | None, out: OutSpec) -> QTensor | torch.Tensor:
    """Quamba int8 causal conv with fused SiLU.

    x: (batch, seqlen, d_inner) int8 at x.scale; weight: (d_inner, d_conv) int8;
    bias: (d_inner,) int8 or None. out: QuantOut(s_u, HALF_AWAY) or FloatOut(fp32).
    Returns (batch, seqlen, d_inner).
    """
    d_conv = weight.shape[1]
    xq = x.codes.to(torch.float32)
    wq = weight.codes.to(torch.float32)
    acc = torch.zeros_like(xq)
    # |acc| <= d_conv * 128 * 128 = 65536 < 2**24: every partial sum is exact in fp32.
    for k in range(d_conv):
        acc += wq[:, k] * _shifted(xq, d_conv - 1 - k)
    scale_wx = f32(weight.scale * x.scale)
    if bias is None:
        bias_val = torch.zeros((), dtype=torch.float32)
    else:
        bias_val = bias.codes.to(torch.float32) * torch.tensor(bias.scale, dtype=torch.float32)
    v = silu_kernel(fma_f32(scale_wx, acc, bias_val))
    return to_output(v, out)


def float_causal_conv1d_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             out: OutSpec, pre_silu: torch.dtype | None = None) -> QTensor | torch.Tensor:
    """Floating-point causal conv + SiLU in fp32: v = ((bias + w0 x_{t-3}) + w1 x_{t-2}) + ..., one rounding a step.

    x: (batch, seqlen, d_inner) fp32 (or QTensor, dequantized); weight: (d_inner, d_conv) fp32;
    bias: (d_inner,) fp32 or None. pre_silu: dtype the conv output is stored in before SiLU
    (fp16 in Quamba's calibration model: its fp16 nn.Conv1d output, then self.act,
    qMambaLayer.py:105-106), or None to apply SiLU to the fp32 value.
    Returns (batch, seqlen, d_inner).
    """
    xf = dequantize(x).to(torch.float32)
    d_conv = weight.shape[1]
    w = weight.to(torch.float32)
    v = torch.zeros_like(xf) if bias is None else bias.to(torch.float32).expand_as(xf).clone()
    for k in range(d_conv):
        v += w[:, k] * _shifted(xf, d_conv - 1 - k)   # product, then sum: two kernels, never an FMA
    if pre_silu is not None:
        v = round_to_dtype(v, pre_silu)
    return to_output(silu_kernel(v), out)


def dequantized_conv1d_silu(x: QTensor, weight: QTensor, bias: QTensor | None) -> torch.Tensor:
    """The Quamba-SE fork's mode-4 conv (798253405/Quamba-SE f4d350a quamba/qConvLayer.py:110-128): input, weight
    and bias dequantized in fp32 (codes * scale), PyTorch's fp32 F.conv1d, then SiLU written as y * sigmoid(y)
    (not the kernel's y / (1 + exp(-y))), no fast math. The taps are summed in this module's fixed order (F.conv1d's
    own order follows the device's library). x: (batch, seqlen, d_inner) -> fp32 (batch, seqlen, d_inner)."""
    xf, w = x.dequantize(), weight.dequantize()
    b = None if bias is None else bias.dequantize()
    d_conv = w.shape[1]
    v = torch.zeros_like(xf) if b is None else b.expand_as(xf).clone()
    for k in range(d_conv):
        v += w[:, k] * _shifted(xf, d_conv - 1 - k)
    return v * sigmoid(v)


def causal_conv1d_silu_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Oracle: the convolution sum written as a loop over tokens, in float64.

    x: (batch, seqlen, d_inner); weight: (d_inner, d_conv); bias: (d_inner,) -> (batch, seqlen, d_inner) float64.
    """
    x = x.to(torch.float64)
    w = weight.to(torch.float64)
    d_conv = w.shape[1]
    out = torch.zeros_like(x)
    for t in range(x.shape[1]):
        for k in range(d_conv):
            src = t - (d_conv - 1) + k
            if src >= 0:
                out[:, t] += w[:, k] * x[:, src]
    if bias is not None:
        out += bias.to(torch.float64)
    return out * torch.sigmoid(out)
