"""Selective scan (Mamba-1 SSM) on dequantized operands, in two arithmetic orders.

Shared by both orders (spec notes §2.6 step 6, §3.4), all fp32, h_{-1} = 0:

    u, B, C, z, D, delta_bias = dequantize(each)                 codes * scale
    A      = -exp(A_log)                                         (d_inner, d_state)
    delta  = softplus(dt + delta_bias), threshold 20: d <= 20 ? log1p(exp(d)) : d
    dA_t   = exp(delta_t * A)
    h_t    = dA_t * h_{t-1} + dBu_t                              sequential in t, two roundings

``KERNEL`` (quant_sscan_fwd_kernel.cuh:154-272):
    dt + delta_bias is one FMA when dt is int8 (s_dt * q + bias);
    dBu_t  = B_t * (delta_t * u_t);
    y_t    = D * u_t, then y_t = fma(h_t[n], C_t[n], y_t) for n = 0 .. d_state-1;
    out_t  = f16((y_t * z_t) / (1 + exp(-z_t))).
``REFERENCE`` (the harness's reference loop, prep=exact; transformers' slow path):
    dBu_t  = (delta_t * B_t) * u_t;
    y_t    = sum_n h_t[n] * C_t[n] (n in order), then + u_t * D;
    out_t  = (y_t * (z_t * sigmoid(z_t))) rounded to the output dtype once.
``TORCH`` (the fork's PyTorch scan, selective_scan_SE.py:219-273; prep=quamba's reference order):
    dBu_t  = (delta_t * B_t) * u_t  (line 219: delta * B_i * u);
    y_t    = (h_t * C_t).sum(dim) over d_state (line 244), as a fixed pairwise sum (the GPU's
             reduction order is not reproducible; torch's CPU order follows the vector width),
             then + u_t * D (line 268);
    out_t  = (y_t * F.silu(z_t)) (line 273) rounded to the output dtype once.
``MAMBA`` (mamba_ssm's floating-point kernel that Quamba's calibration model runs,
selective_scan_fwd_kernel.cuh:158-298 of the vendored 3rdparty/mamba): ``KERNEL``'s order
(y starts at D * u, one FMA per state) with the gate out_t = y_t * (z_t / (1 + exp(-z_t))) (line 298).

The GPU kernel runs the recurrence as a parallel (tree-order) scan with `__expf`;
neither is reproducible on a CPU, so both orders use the sequential recurrence, and every
exp, log1p and sigmoid is ``portable``'s (correctly rounded, the same bits on every CPU).
Time is processed in chunks to bound memory; chunking does not change any
arithmetic (elementwise ops, and the recurrence carries h across chunks).
"""
from __future__ import annotations

import enum

import torch

from ..spec import FloatOut, FormatOut, QTensor
from . import portable
from .quant import dequantize, fma_f32, to_output

__all__ = ["ScanOrder", "selective_scan", "selective_scan_ref", "softplus_thresholded"]

_CHUNK_ELEMENTS = 1 << 20  # 4 MB of fp32 per (chunk, batch, d_state, d_inner) buffer: stays in cache


class ScanOrder(str, enum.Enum):
    KERNEL = "kernel"
    REFERENCE = "reference"
    TORCH = "torch"
    MAMBA = "mamba"


def softplus_thresholded(x: torch.Tensor) -> torch.Tensor:
    """log1p(exp(x)) for x <= 20, x above (the kernel's and F.softplus' threshold); portable exp and log1p."""
    return portable.softplus(x, 20.0)


def _delta(delta: QTensor | torch.Tensor, delta_bias: torch.Tensor, order: ScanOrder) -> torch.Tensor:
    if order is ScanOrder.KERNEL and isinstance(delta, QTensor):
        pre = fma_f32(delta.scale, delta.codes.to(torch.float32), delta_bias)
    else:
        pre = dequantize(delta) + delta_bias
    return softplus_thresholded(pre)


def _recurrence(dA: torch.Tensor, dBu: torch.Tensor, h: torch.Tensor, states: torch.Tensor,
                state_fmt: str | None = None) -> torch.Tensor:
    """h_t = dA_t * h_{t-1} + dBu_t for t in the chunk, written into `states`; all (chunk, batch, d_state, d_inner).
    state_fmt: each h_t is stored in that number format (fake_quantize along d_inner) before the next step."""
    for t in range(dBu.shape[0]):
        torch.mul(dA[t], h, out=states[t])
        states[t].add_(dBu[t])
        if state_fmt is not None:
            states[t].copy_(to_output(states[t], FormatOut(state_fmt)))
        h = states[t]
    return states


def _output(states: torch.Tensor, C: torch.Tensor, u: torch.Tensor, D: torch.Tensor, order: ScanOrder) -> torch.Tensor:
    """Contract the state with C; states: (chunk, batch, d_state, d_inner), C: (chunk, batch, d_state)."""
    d_state = states.shape[2]
    if order is ScanOrder.TORCH:
        # (h * C).sum(dim) with d_state contiguous, as the fork's (B, D, N) state: (chunk, batch, d_inner, d_state)
        prod = states.transpose(2, 3) * C[:, :, None, :]
        return portable.sum_last(prod)[..., 0] + u * D
    if order in (ScanOrder.KERNEL, ScanOrder.MAMBA):
        # y = fma(h_n, C_n, y) in turn, as fma_f32: the float64 products of fp32 numbers are exact (all taken
        # at once); each step adds in float64 (y's fp32 values promoted exactly) and rounds once to fp32 on
        # storing into y (torch computes a mixed-dtype add in the promoted dtype, then casts to `out`)
        prods = states.to(torch.float64).mul_(C.to(torch.float64)[:, :, :, None])
        y = D * u
        for n in range(d_state):
            torch.add(y, prods[:, :, n], out=y)
        return y
    y = states[:, :, 0] * C[:, :, 0, None]
    for n in range(1, d_state):
        y = y + states[:, :, n] * C[:, :, n, None]
    return y + u * D


def _gate(y: torch.Tensor, z: torch.Tensor, order: ScanOrder) -> torch.Tensor:
    if order is ScanOrder.KERNEL:
        return (y * z) / (portable.exp(-z) + 1.0)
    if order is ScanOrder.MAMBA:
        return y * (z / (portable.exp(-z) + 1.0))
    if order is ScanOrder.TORCH:
        return y * portable.silu(z)
    return y * (z * portable.sigmoid(z))


def selective_scan(u: QTensor | torch.Tensor, delta: QTensor | torch.Tensor, A_log: QTensor | torch.Tensor,
                   B: QTensor | torch.Tensor, C: QTensor | torch.Tensor, D: QTensor | torch.Tensor,
                   z: QTensor | torch.Tensor, *, delta_bias: QTensor | torch.Tensor, order: ScanOrder,
                   out: FloatOut | FormatOut, h0: torch.Tensor | None = None,
                   state_fmt: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the scan; every operand may be int8 (dequantized here) or fp32.

    u, delta, z: (batch, seqlen, d_inner); B, C: (batch, seqlen, d_state);
    A_log: (d_inner, d_state); D, delta_bias: (d_inner,).
    Returns y: (batch, seqlen, d_inner) fp32 holding out.dtype values, and the
    final state h: (batch, d_inner, d_state) fp32. h0: the state before the first token,
    (batch, d_inner, d_state) fp32 (zero when None): a decode step is this scan over one token from
    the carried state, so it repeats the prefill's arithmetic at that position bit for bit.
    state_fmt: a number format the state is stored in after every step (None: fp32, as every built-in
    mode); its scale groups run along d_inner.
    """
    u, z, Bf, Cf = dequantize(u), dequantize(z), dequantize(B), dequantize(C)
    A = -portable.exp(dequantize(A_log))                                   # (d_inner, d_state)
    At = A.t().contiguous()                                                # (d_state, d_inner)
    Df, bias = dequantize(D), dequantize(delta_bias)
    dt = _delta(delta, bias, order)                                        # (batch, seqlen, d_inner)
    batch, seqlen, d_inner = u.shape
    d_state = At.shape[0]
    chunk = max(1, min(seqlen, _CHUNK_ELEMENTS // max(1, batch * d_state * d_inner)))
    h = torch.zeros(batch, d_state, d_inner, dtype=torch.float32) if h0 is None else \
        h0.to(torch.float32).transpose(1, 2).contiguous()
    y = torch.empty(batch, seqlen, d_inner, dtype=torch.float32)
    # three (chunk, batch, d_state, d_inner) buffers reused by every chunk; in-place ops, same arithmetic
    buffers = torch.empty(3, chunk, batch, d_state, d_inner, dtype=torch.float32)
    for t0 in range(0, seqlen, chunk):
        # fmt: off
        sl = slice(t0, min(seqlen, t0 + chunk))
        n = sl.stop - sl.start
        dA, dBu, states = buffers[0, :n], buffers[1, :n], buffers[2, :n]
        dt_c = dt[:, sl].transpose(0, 1)                                   # (chunk, batch, d_inner)
        u_c = u[:, sl].transpose(0, 1)
        B_c = Bf[:, sl].transpose(0, 1)                                    # (chunk, batch, d_state)
        C_c = Cf[:, sl].transpose(0, 1)
        portable.exp_(torch.mul(dt_c[:, :, None, :], At, out=dA))          # exp(delta * A)
        if order in (ScanOrder.KERNEL, ScanOrder.MAMBA):
            torch.mul(B_c[..., None], (dt_c * u_c)[:, :, None, :], out=dBu)  # B * (delta * u)
        else:
            torch.mul(dt_c[:, :, None, :], B_c[..., None], out=dBu).mul_(u_c[:, :, None, :])  # (delta * B) * u
        states = _recurrence(dA, dBu, h, states, state_fmt)
        h = states[-1].clone()
        y[:, sl] = _output(states, C_c, u_c, Df, order).transpose(0, 1)   # (batch, chunk, d_inner)
        # fmt: on
    y = _gate(y, z, order)
    return to_output(y, out), h.transpose(1, 2).contiguous()


def selective_scan_ref(u: torch.Tensor, delta: torch.Tensor, A_log: torch.Tensor, B: torch.Tensor,
                       C: torch.Tensor, D: torch.Tensor, z: torch.Tensor, *,
                       delta_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Oracle: one step at a time in float64 on real-valued operands (no rounding anywhere).

    Same shapes as ``selective_scan``; returns (y, last_state) in float64.
    """
    u, delta, B, C, z = (t.to(torch.float64) for t in (u, delta, B, C, z))
    A = -torch.exp(A_log.to(torch.float64))
    dt = torch.nn.functional.softplus(delta + delta_bias.to(torch.float64))
    h = torch.zeros(u.shape[0], u.shape[2], A.shape[1], dtype=torch.float64)  # (batch, d_inner, d_state)
    ys = []
    for t in range(u.shape[1]):
        h = torch.exp(dt[:, t, :, None] * A) * h + dt[:, t, :, None] * B[:, t, None, :] * u[:, t, :, None]
        ys.append(torch.einsum("bdn,bn->bd", h, C[:, t]) + D.to(torch.float64) * u[:, t])
    y = torch.stack(ys, dim=1)
    return y * z * torch.sigmoid(z), h
