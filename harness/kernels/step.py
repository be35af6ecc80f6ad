"""Decode-step ops of a linear layer and the conv: the W8A8 GEMV and the conv-window update.

Sources: enyac-group/Quamba c474646 (``UP``) and the notes ``quamba1-decode-notes.md`` §2.

W8A8 GEMV (one token: ``x.shape[0] == 1`` in ``W8A8B8O8Linear.forward``, UP quamba/qLinearLayer.py:615-616,
``cutlass_scaled_mv_dq(y, W.t(), x, alpha, 0.0)``): the int32 accumulator is exact, and the epilogue
multiplies by **one** precomputed fp32 ``alpha`` (CUTLASS LinearCombination, beta = 0):

    int8 output  (W8A8B8O8,   alpha at UP qLinearLayer.py:587): alpha = f32(f32(s_w * s_x) / s_out)
                 q = sat8(RNE(f32(alpha * f32(acc))))           (cvt.rni.sat.s8.f32)
    float output (W8A8B16O16, alpha at UP qLinearLayer.py:784): alpha = f32(s_w * s_x)
                 y = f16(f32(alpha * f32(acc)))                 (__float2half_rn)

The prefill GEMM multiplies by two scales in turn (``kernels.linear``); the two differ in the last bit.

Int8 conv-window update (UP csrc/causal_conv1d/quant_causal_conv1d_update_kernel.cuh:50-75): the
window (int8 codes at s_x) shifts left and takes the new code at its end (59-66); then

    v = f32(f32(b_q) * s_b)                                       (50-51)
    v = fma(f32(f32(s_w * s_x) * w_k), f32(x_k), v)  k = 0..K-1   (68-70: ``out += s_w * s_x * w * x``, nvcc's FMA)
    v = v / (1 + exp(-v))                                         (71; the GPU's __expf: not reproduced)
    u = sat8(RNA(v / s_u))                                        (73-74: roundf, clamp)

The float update (mamba_ssm ``Mamba.step``, enyac-group/mamba f034308 mamba_simple.py:216-221) sums
bias, then tap 0..K-1, one product and one sum each: the order of the prefill's float conv
(``kernels.conv1d.float_causal_conv1d_silu``), so a step equals the prefill at that position bit for bit.
"""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import torch

from ..spec import FloatOut, OutSpec, QTensor, QuantOut, Rounding
from .conv1d import silu_kernel
from .linear import int8_gemm_float
from .quant import f32, fma_f32, quantize_prescaled, round_to_dtype, to_output
from .rounding import round_half_away

__all__ = ["gemv_alpha", "w8a8_gemv", "w8a8_gemv_ref", "shift_window", "int8_conv_update",
           "int8_conv_update_ref", "float_conv_update", "fma_f32_exact"]


def gemv_alpha(s_x: float, s_w: float, out: OutSpec) -> float:
    """The GEMV's one fp32 scale: f32(f32(s_w * s_x) / s_out) for an int8 output, f32(s_w * s_x) for a float one."""
    sw_sx = f32(s_w * s_x)
    return f32(sw_sx / out.scale) if isinstance(out, QuantOut) else sw_sx


def w8a8_gemv(x: QTensor, w: QTensor, out: OutSpec, w_float: torch.Tensor | None = None) -> QTensor | torch.Tensor:
    """Quamba's one-token W8A8 linear layer: x (..., k) int8, w (n, k) int8 -> (..., n) int8 at s_out or float.
    w_float: w's codes as fp32, kept by the caller between steps (the same exact integer sums)."""
    x2 = x.codes.reshape(-1, x.codes.shape[-1])
    acc = int8_gemm_float(x2, w.codes, w_float).reshape(*x.codes.shape[:-1], w.codes.shape[0]).to(torch.float32)
    v = torch.tensor(gemv_alpha(x.scale, w.scale, out), dtype=torch.float32) * acc
    if isinstance(out, QuantOut):
        assert out.rounding is Rounding.HALF_EVEN, "the CUTLASS GEMV epilogue rounds half to even"
        return quantize_prescaled(v, out.scale, out.rounding)
    return to_output(v, out)


def w8a8_gemv_ref(x: QTensor, w: QTensor, out: OutSpec) -> QTensor | torch.Tensor:
    """Oracle for ``w8a8_gemv``: Python-integer dot products and the scalar epilogue, element by element."""
    xs, ws = x.codes.reshape(-1, x.codes.shape[-1]).tolist(), w.codes.tolist()
    alpha = np.float32(np.float32(np.float32(w.scale) * np.float32(x.scale)))
    if isinstance(out, QuantOut):
        alpha = np.float32(alpha / np.float32(out.scale))
    rows = []
    for xr in xs:
        row = []
        for wr in ws:
            v = np.float32(alpha * np.float32(sum(a * b for a, b in zip(xr, wr))))
            if isinstance(out, QuantOut):
                r = float(np.rint(v))  # round half to even
                row.append(int(min(127.0, max(-128.0, r))))
            else:
                row.append(float(np.float32(v).astype(np.float16 if out.dtype == torch.float16 else np.float32)))
        rows.append(row)
    shape = (*x.codes.shape[:-1], w.codes.shape[0])
    if isinstance(out, QuantOut):
        return QTensor(torch.tensor(rows, dtype=torch.int8).reshape(shape), out.scale)
    return torch.tensor(rows, dtype=torch.float32).reshape(shape)


def shift_window(window: torch.Tensor, x_t: torch.Tensor) -> torch.Tensor:
    """The conv window after one token: window (batch, d_inner, d_conv) loses its oldest column and takes
    x_t (batch, d_inner) at its end (UP quant_causal_conv1d_update_kernel.cuh:59-66)."""
    return torch.cat([window[..., 1:], x_t[..., None].to(window.dtype)], dim=-1)


def int8_conv_update(window: QTensor, weight: QTensor, bias: QTensor | None, out: OutSpec) -> QTensor | torch.Tensor:
    """The int8 conv of one token over its (already shifted) window: the kernel's FMA chain, SiLU, output rule.

    window: (batch, d_inner, d_conv) int8 at s_x; weight: (d_inner, d_conv) int8; bias: (d_inner,) int8 or None;
    out: QuantOut(s_u, HALF_AWAY) or FloatOut(fp32) (the true fp32 conv). Returns (batch, d_inner).
    """
    sw_sx = torch.tensor(f32(weight.scale * window.scale), dtype=torch.float32)
    if bias is None:
        v = torch.zeros(window.codes.shape[:-1], dtype=torch.float32)
    else:  # float(b) * scale_b in fp32 (lines 50-51)
        v = (bias.codes.to(torch.float32) * torch.tensor(bias.scale, dtype=torch.float32)).expand(
            window.codes.shape[:-1]).contiguous()
    wq = weight.codes.to(torch.float32)
    xq = window.codes.to(torch.float32)
    for k in range(wq.shape[1]):  # (s_w * s_x) * w_k rounded, then one FMA with x_k (line 70)
        v = fma_f32(sw_sx * wq[:, k], xq[..., k], v)
    return to_output(silu_kernel(v), out)


def fma_f32_exact(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    """fp32 a * b + c rounded once (exact rational arithmetic, nearest, ties to even)."""
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    guess = np.float32(float(exact))
    cands = [np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))]
    dist = [abs(Fraction(float(g)) - exact) for g in cands]
    best = min(dist)
    ties = [g for g, d in zip(cands, dist) if d == best]
    return ties[0] if len(ties) == 1 else next(g for g in ties if int(g.view(np.int32)) % 2 == 0)


def int8_conv_update_ref(window: QTensor, weight: QTensor, bias: QTensor | None, out: OutSpec) -> torch.Tensor | QTensor:
    """Oracle for ``int8_conv_update``: the kernel's loop per (batch, channel), scalar fp32 with exact FMAs.

    SiLU uses the same exp as the op (``kernels.portable``): what is checked is the chain and the rounding.
    """
    from .portable import exp
    b_, d_, k_ = window.codes.shape
    sw_sx = np.float32(np.float32(weight.scale) * np.float32(window.scale))
    res = torch.empty(b_, d_, dtype=torch.float32)
    for b in range(b_):
        for d in range(d_):
            v = np.float32(0.0) if bias is None else np.float32(np.float32(int(bias.codes[d])) * np.float32(bias.scale))
            for k in range(k_):
                coef = np.float32(sw_sx * np.float32(int(weight.codes[d, k])))
                v = fma_f32_exact(coef, np.float32(int(window.codes[b, d, k])), v)
            e = np.float32(float(exp(torch.tensor([-float(v)], dtype=torch.float32))[0]))
            res[b, d] = float(np.float32(v / np.float32(e + np.float32(1.0))))
    if isinstance(out, FloatOut):
        return res
    q = round_half_away(res / torch.tensor(out.scale, dtype=torch.float32)).clamp(-128, 127)
    return QTensor(q.to(torch.int8), out.scale)


def float_conv_update(window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: OutSpec,
                      pre_silu: torch.dtype | None = None) -> QTensor | torch.Tensor:
    """The float conv of one token over its (already shifted) window: bias, then + w_k * x_k for k = 0..K-1.

    window: (batch, d_inner, d_conv) fp32; weight: (d_inner, d_conv); bias: (d_inner,) or None -> (batch, d_inner).
    """
    w = weight.to(torch.float32)
    v = torch.zeros(window.shape[:-1], dtype=torch.float32) if bias is None else \
        bias.to(torch.float32).expand(window.shape[:-1]).clone()
    for k in range(w.shape[1]):
        v += w[:, k] * window[..., k]   # product, then sum, as the prefill's float conv
    if pre_silu is not None:
        v = round_to_dtype(v, pre_silu)
    return to_output(silu_kernel(v), out)
