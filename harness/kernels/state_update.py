"""The SSM state update of one decode step, with the int8 state of Quamba1's W8A8 step.

Quamba's Triton kernel ``_quant_sscan_update_kernel`` (enyac-group/Quamba c474646
quamba/triton/selective_state_update.py:83-126), per channel e and state n, all fp32:

    x = s_u * u_q                       (83)        state = s_h * h_q          (84-85: the int8 state, dequantized)
    dt = s_dt * dt_q;  dt += s_b * b_q  (87-90)     dt = log(exp(dt) + 1) if dt <= 20   (94; enyac-group/mamba f034308
                                                          mamba_ssm/ops/triton/softplus.py:8-12, Triton >= 3: not log1p)
    A = -exp(s_A * A_q)                 (96)        dA = exp(A * dt)           (97)
    B, C, D, z = s * q                  (107-112)   dB = B * dt                (115)
    state' = state * dA + dB * x        (118)
    h_q' = sat8(rint((state' * 1e2) / (s_h * 1e2)))  (119: RNE, stored back as int8, 120)
    y = sum_n state'_n * C_n            (121: from the fp32 state', not from the codes)
    y += x * D;  y *= z * sigmoid(z)    (122-125)   y stored fp16 (126, 194)

This is the canonical CPU rendering of the notes (§4), each choice one of the readings the GPU allows:
``dt = fma(s_b, b_q, s_dt * dt_q)``; ``state' = fma(state, dA, f32(dB * x))``; the sum sequential
n = 0..N-1; ``y = fma(x, D, y)``; ``y * f32(z * (1 / (1 + exp(-z))))``. exp and log are ``kernels.portable``'s
(correctly rounded; the GPU's ex2.approx / lg2.approx and div.full are not reproduced).

The prefill hands its fp32 state over as int8 codes with another rule (quant_sscan_fwd_kernel.cuh:237-242:
``int(roundf(h / s_h))`` clamped: RNA, no 1e2): ``handover_codes``.
"""
from __future__ import annotations

import numpy as np
import torch

from ..spec import FloatOut, QTensor
from . import portable
from .quant import dequantize, f32, fma_f32, quantize, quantize_prescaled, round_to_dtype
from ..spec import Rounding

__all__ = ["requantize_state", "handover_codes", "triton_softplus", "quant_state_update", "quant_state_update_ref"]


def requantize_state(h: torch.Tensor, s_h: float) -> QTensor:
    """The kernel's state re-quantization: sat8(RNE(f32(h * 100) / f32(s_h * 100))), h (...) fp32."""
    num = h.to(torch.float32) * torch.tensor(1e2, dtype=torch.float32)
    den = torch.tensor(s_h, dtype=torch.float32) * torch.tensor(1e2, dtype=torch.float32)
    return quantize_prescaled(num / den, s_h, Rounding.HALF_EVEN)


def handover_codes(h: torch.Tensor, s_h: float) -> QTensor:
    """The prefill's final fp32 state as the step's int8 state: sat8(RNA(f32(h / s_h))) (the scan kernel's
    ``roundf(h / scale_ssm_state)``, quant_sscan_fwd_kernel.cuh:240-241). h: (batch, d_inner, d_state)."""
    return quantize(h, s_h, Rounding.HALF_AWAY)


def triton_softplus(dt: torch.Tensor) -> torch.Tensor:
    """log(f32(exp(dt) + 1)) for dt <= 20, dt above (mamba_ssm/ops/triton/softplus.py:8-12, Triton >= 3)."""
    e = portable.exp(dt.clamp(max=20.0)) + 1.0
    return torch.where(dt <= 20.0, portable.log(e), dt)


def _dt(delta, dt_bias) -> torch.Tensor:
    if isinstance(delta, QTensor) and isinstance(dt_bias, QTensor):  # dt += s_b * b_q: one FMA after s_dt * dt_q
        pre = delta.codes.to(torch.float32) * torch.tensor(delta.scale, dtype=torch.float32)
        return fma_f32(f32(dt_bias.scale), dt_bias.codes.to(torch.float32), pre)
    return dequantize(delta) + dequantize(dt_bias)


def quant_state_update(h: QTensor, u, delta, A_log, B, C, *, D, z, dt_bias,
                       out: FloatOut) -> tuple[torch.Tensor, QTensor, torch.Tensor]:
    """One step of the kernel above. Operands may be int8 QTensors or fp32 (dequantized as the kernel does).

    h: (batch, d_inner, d_state) int8 at s_h; u, delta, z: (batch, d_inner); B, C: (batch, d_state);
    A_log: (d_inner, d_state); D, dt_bias: (d_inner,).
    Returns y (batch, d_inner) fp32 holding out.dtype values, the new int8 state and the fp32 state' it came from.
    """
    x, state = dequantize(u), h.dequantize()
    dt = triton_softplus(_dt(delta, dt_bias))                                   # (batch, d_inner)
    A = -portable.exp(dequantize(A_log))                                         # (d_inner, d_state)
    dA = portable.exp(A * dt[..., None])                                         # (batch, d_inner, d_state)
    Bf, Cf, Df, zf = dequantize(B), dequantize(C), dequantize(D), dequantize(z)
    dB = Bf[:, None, :] * dt[..., None]
    new = fma_f32(state, dA, dB * x[..., None])                                  # fma(state, dA, f32(dB * x))
    prods = new * Cf[:, None, :]
    y = prods[..., 0]
    for n in range(1, prods.shape[-1]):
        y = y + prods[..., n]
    y = fma_f32(x, Df, y)
    y = y * (zf * (1.0 / (portable.exp(-zf) + 1.0)))
    return round_to_dtype(y, out.dtype), requantize_state(new, h.scale), new


def _scalar_exp(v: np.float32) -> np.float32:
    return np.float32(float(portable.exp(torch.tensor([float(v)], dtype=torch.float32))[0]))


def _scalar_log(v: np.float32) -> np.float32:
    return np.float32(float(portable.log(torch.tensor([float(v)], dtype=torch.float32))[0]))


def quant_state_update_ref(h: QTensor, u: QTensor, delta: QTensor, A_log: QTensor, B: QTensor, C: QTensor, *,
                           D: QTensor, z: QTensor, dt_bias: QTensor,
                           out: FloatOut) -> tuple[torch.Tensor, QTensor, torch.Tensor]:
    """Oracle for ``quant_state_update`` on all-int8 operands: the kernel's program for one channel written
    out as scalar fp32 code (numpy float32, exact FMAs), channel by channel and state by state.
    Returns y (batch, d_inner) out.dtype values as fp32, the int8 state and the fp32 state'."""
    from .step import fma_f32_exact
    f, out_dtype = np.float32, out.dtype
    bsz, d_inner, d_state = h.codes.shape
    y = torch.empty(bsz, d_inner, dtype=torch.float32)
    q = torch.empty(bsz, d_inner, d_state, dtype=torch.int8)
    states = torch.empty(bsz, d_inner, d_state, dtype=torch.float32)
    s_h = f(h.scale)
    for b in range(bsz):
        for e in range(d_inner):
            x = f(f(u.scale) * f(int(u.codes[b, e])))
            dt = fma_f32_exact(f(dt_bias.scale), f(int(dt_bias.codes[e])), f(f(delta.scale) * f(int(delta.codes[b, e]))))
            if dt <= f(20.0):
                dt = _scalar_log(f(_scalar_exp(dt) + f(1.0)))
            acc = None
            for n in range(d_state):
                A = -_scalar_exp(f(f(A_log.scale) * f(int(A_log.codes[e, n]))))
                dA = _scalar_exp(f(A * dt))
                dB = f(f(f(B.scale) * f(int(B.codes[b, n]))) * dt)
                state = f(s_h * f(int(h.codes[b, e, n])))
                new = fma_f32_exact(state, dA, f(dB * x))
                states[b, e, n] = float(new)
                r = float(np.rint(f(f(new * f(100.0)) / f(s_h * f(100.0)))))
                q[b, e, n] = int(min(127.0, max(-128.0, r)))
                p = f(new * f(f(C.scale) * f(int(C.codes[b, n]))))
                acc = p if acc is None else f(acc + p)
            yy = fma_f32_exact(x, f(f(D.scale) * f(int(D.codes[e]))), acc)
            zz = f(f(z.scale) * f(int(z.codes[b, e])))
            yy = f(yy * f(zz * f(f(1.0) / f(_scalar_exp(-zz) + f(1.0)))))
            y[b, e] = float(yy.astype(np.float16) if out_dtype == torch.float16 else yy)
    return y, QTensor(q, h.scale), states
