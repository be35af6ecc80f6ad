"""Quamba2's W8A8 decode-step ops of the Mamba-2 block, each with a written-out ``*_ref`` twin.

Sources: enyac-group/Quamba c474646 (``W8A8QMamba2.step``, quamba/qMamba2.py:1336-1358).

in_proj on one token (``W8A8B8O8LinearParallel.forward``, quamba/qLinearLayer.py:733-736: batch * seqlen = 1
takes ``w8a8o8_gemv(y, W.t(), x, b, a)``; kernel csrc/linear/quant_linear_fwd_gemv_kernel.cuh:27-61): an exact
int32 dot product per output column j, then ``scale = s_a[j] * s_b[0]`` with s_a = b (the per-column factor
f32(s_w / s_out)) and s_b = a (the input scale) (:56), and ``roundf`` (half **away** from zero) with saturation
(:58-59):

    q[j] = sat8(RNA(f32(f32(b[j] * a) * f32(acc[j]))))

(the prefill's CUTLASS GEMM instead computes f32(a * f32(b[j] * acc)) and rounds half to even, kernels.conv1d_grouped).
The kernel strides K by 32 without a bound check (:44-47) and needs 16-byte aligned rows (:119-120): Quamba's
GEMV is only correct for d_model % 32 == 0; the harness computes the exact sum for any d_model.

conv window update (``Quamb2Conv1D.update``, quamba/qConvLayer.py:189-199; kernel
csrc/causal_conv1d/quamba2_conv1d_update_kernel.cuh:26-147), per channel of x | B | C: the window of int8
conv inputs (in_proj's codes at s_x, s_B or s_C) shifts left and takes the new code (:53-60); then

    v = f32(s_b * float(bias_q))                                     (:139)
    v = fma(f32(f32(s_w * s_in) * w_k), float(x_k), v)  k = 0..K-1   (:79/115/128 scale_in, :141; nvcc's FMA)
    v = v / (1 + expf(-v))                                           (:142; the GPU's fast-math expf not reproduced)
    q = sat8(roundf(v / s_out[c]))                                   (:144-145, RNA)

with s_out[c] the channel's x group scale (:83-107, the same lookup as the prefill) or its SSD group's B / C
scale (:116-121, :129-134). The prefill conv sums the integer products first (kernels.conv1d_grouped.q2_conv1d).

SSM state update (``Quamba2ChunkScan.update``, quamba/qChunkScan.py:234-244, calling
``quamba2_sscan_update_triton`` with q_A_log, q_D and dt_bias repeated over headdim by ``repeat`` (:188-199),
so ``tie_hdim`` holds (quamba/triton/selective_state_update.py:450) and dt, dA are one value per head;
kernel ``_quamba2_sscan_update_kernel`` :225-362), per (head h, channel p, state n), fp32, no z (z=None, :241):

    x = x_scale(p) * float(q_x)                         (:310-315; x's (head group, dim group) scale)
    state = s_state[g, hg, dg, n] * float(code)         (:317-322; ssm_state_scale [ngroups, 4, 4, d_state])
    dt = dt_scale * float(q_dt);  dt += float(dt_bias)  (:333-335: fma(dt_scale, q_dt, dt_bias) here)
    dt = softplus(dt) = log(exp(dt) + 1) if dt <= 20    (:336-337; mamba_ssm triton softplus, kernels.state_update)
    A = -exp(A_scale * float(q_A));  dA = exp(A * dt)   (:338-339)
    B, C = s_{B,C}[g] * float(code);  D = D_scale * q_D (:341-345)
    dB = B * dt                                         (:352)
    state' = state * dA + dB * x                        (:353: fma(state, dA, f32(dB * x)) here)
    code' = clamp(rint((state' * 1e6) / (s_state * 1e6)), -128, 127)   (:355; RNE)
    y = sum_n state'_n * C_n                            (:357, from the fp32 state', not from code')
    y += x * D                                          (:358-359: fma(x, D, y) here)
    y stored fp16                                       (:433 ``out = empty_like(q_x, dtype=float16)``)

The choices marked "here" are the canonical CPU rendering of docs/spec/quamba1-decode-notes.md §4 applied to the
same Triton program shape; exp/log are kernels.portable's (correctly rounded; the GPU's ex2.approx / lg2.approx and
div.full are not reproduced), the sum is sequential n = 0..N-1 (tl.sum's tree is not reproduced).

Hand-over from the prefill (quamba/triton/quant_ssd_combined.py:148-162): the final state leaves
``_quant_state_passing_fwd`` as **fp16** (out_dtype = mm_dtype, quant_state_passing.py:96-98) and is quantized by
``_quamba2_quant_ssm_states`` (quamba/triton/quant_ssm_states.py:112-117) with the same ``rint(·1e6 / ·1e6)``
rule: ``handover_q2_state``. The cache then holds int8 codes whichever dtype it has (module emulation.state).
"""
from __future__ import annotations

import numpy as np
import torch

from ..spec import QTensor
from . import portable
from .conv1d import silu_kernel
from .linear import int8_gemm
from .ssd_inputs import Q2SSDParams
from .quant import fma_f32, round_to_dtype
from .rounding import round_half_away, round_half_even
from .state_update import triton_softplus
from .step import fma_f32_exact, shift_window

__all__ = ["q2_gemv", "q2_gemv_ref", "q2_conv_update", "q2_conv_pre_act", "q2_conv_update_ref", "q2_state_scales",
           "dequantize_q2_state", "requantize_q2_state", "handover_q2_state", "q2_state_update",
           "q2_state_update_ref", "REQUANT_MUL"]

REQUANT_MUL = 1e6  # the ``state * 1e6 / (scale * 1e6)`` of selective_state_update.py:355 and quant_ssm_states.py:113


def q2_gemv(x: QTensor, w_codes: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """One token through Quamba2's in_proj GEMV. x: (..., k) int8 at x.scale (``a``); w_codes: (n, k) int8;
    b: (n,) fp32 per-column factors. Returns (..., n) int8 codes (module docstring)."""
    acc = int8_gemm(x.codes, w_codes).to(torch.float32)
    scale = b.to(torch.float32) * torch.tensor(x.scale, dtype=torch.float32)   # s_a[warp_col] * s_b[0]
    return round_half_away(scale * acc).clamp(-128, 127).to(torch.int8)


def q2_gemv_ref(x: QTensor, w_codes: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Oracle of q2_gemv: the kernel's warp per column, Python-integer sums, scalar fp32 epilogue, roundf."""
    xs = x.codes.reshape(-1, x.codes.shape[-1]).tolist()
    ws, bs, a = w_codes.tolist(), b.to(torch.float32).tolist(), np.float32(x.scale)
    out = np.zeros((len(xs), len(ws)), dtype=np.int8)
    for r, xr in enumerate(xs):
        for j, wr in enumerate(ws):
            tmp = sum(p * q for p, q in zip(wr, xr))
            v = float(np.float32(np.float32(np.float32(bs[j]) * a) * np.float32(tmp)))
            rounded = float(np.sign(v) * np.floor(abs(v) + 0.5))   # roundf: half away from zero
            out[r, j] = int(min(127.0, max(-128.0, rounded)))
    return torch.from_numpy(out).reshape(*x.codes.shape[:-1], w_codes.shape[0])


def _section_scales(values: tuple[float, float, float], x_dim: int, bc: int) -> torch.Tensor:
    return torch.tensor([values[0]] * x_dim + [values[1]] * bc + [values[2]] * bc, dtype=torch.float32)


def q2_conv_update(window: torch.Tensor, x_t: torch.Tensor, in_scales: tuple[float, float, float],
                   conv: tuple, out_scales: torch.Tensor, *, x_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One token through Quamba2's conv update (module docstring).

    window: (batch, conv_dim, K) int8, the K conv inputs before this token; x_t: (batch, conv_dim) int8, this
    token's in_proj codes; in_scales: (s_x, s_B, s_C); conv: (weight (conv_dim, K) int8, w_scales, bias
    (conv_dim,) int8 or None, b_scales) as q2_params.Q2Params.conv; out_scales: (conv_dim,) fp32.
    Returns (output codes (batch, conv_dim) int8, the window ending with this token).
    """
    win = shift_window(window, x_t)
    v = q2_conv_pre_act(win, in_scales, conv, x_dim=x_dim)
    q = round_half_away(silu_kernel(v) / out_scales.to(torch.float32)).clamp(-128, 127)
    return q.to(torch.int8), win


def q2_conv_pre_act(win: torch.Tensor, in_scales: tuple[float, float, float], conv: tuple, *,
                    x_dim: int) -> torch.Tensor:
    """The update kernel's sum before SiLU over a shifted window (batch, conv_dim, K) int8: the bias product,
    then one FMA per tap (quamba2_conv1d_update_kernel.cuh:139-141). Returns (batch, conv_dim) fp32."""
    weight, w_scales, bias, b_scales = conv
    conv_dim, K = weight.shape
    bc = (conv_dim - x_dim) // 2
    scale_in = _section_scales(tuple(float(np.float32(np.float32(sw) * np.float32(sx)))
                                     for sw, sx in zip(w_scales, in_scales)), x_dim, bc)
    if bias is None:
        v = torch.zeros(win.shape[:-1], dtype=torch.float32)
    else:
        v = (_section_scales(b_scales, x_dim, bc) * bias.to(torch.float32)).expand(win.shape[:-1]).contiguous()
    wq, xq = weight.to(torch.float32), win.to(torch.float32)
    for k in range(K):
        v = fma_f32(scale_in * wq[:, k], xq[..., k], v)
    return v


def q2_conv_update_ref(window: torch.Tensor, x_t: torch.Tensor, in_scales: tuple[float, float, float],
                       conv: tuple, out_scales: torch.Tensor, *, x_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Oracle of q2_conv_update: the kernel's thread per (batch, channel), scalar fp32, exact FMAs."""
    weight, w_scales, bias, b_scales = conv
    bsz, conv_dim, K = window.shape
    bc = (conv_dim - x_dim) // 2
    f = np.float32
    out = torch.empty(bsz, conv_dim, dtype=torch.int8)
    new = torch.empty_like(window)
    for n in range(bsz):
        for c in range(conv_dim):
            s = 0 if c < x_dim else (1 if c < x_dim + bc else 2)
            vals = [int(window[n, c, i + 1]) for i in range(K - 1)] + [int(x_t[n, c])]
            for i in range(K):
                new[n, c, i] = vals[i]
            scale_in = f(f(w_scales[s]) * f(in_scales[s]))
            v = f(0.0) if bias is None else f(f(b_scales[s]) * f(int(bias[c])))
            for i in range(K):
                v = fma_f32_exact(f(scale_in * f(int(weight[c, i]))), f(vals[i]), v)
            e = f(float(portable.exp(torch.tensor([-float(v)], dtype=torch.float32))[0]))
            v = f(v / f(f(1.0) + e))
            r = float(f(v / f(out_scales[c])))
            q = float(np.sign(r) * np.floor(abs(r) + 0.5))
            out[n, c] = int(min(127.0, max(-128.0, q)))
    return out, new


def q2_state_scales(table: torch.Tensor, head_range: torch.Tensor, dim_range: torch.Tensor,
                    nheads: int, headdim: int) -> torch.Tensor:
    """Each state element's scale, looked up as the Triton kernels do (selective_state_update.py:300-321,
    quant_ssm_states.py:99-110): head h belongs to SSD group g = h // (nheads / ngroups), head group
    ``sum(h % ratio >= head_range[g])``, its channel p to dim group ``sum(p >= dim_range[g, hg])``.

    table: (ngroups, n_head_groups, n_dim_groups, d_state) fp32 (ssm_state_scale); head_range, dim_range: the
    cumulative ends (grouping_q2.group_ranges). Returns (nheads, headdim, d_state) fp32; 0 where the dim group
    falls outside the table (the kernel's masked load)."""
    ngroups, _, ndg, d_state = table.shape
    ratio = nheads // ngroups
    out = torch.zeros(nheads, headdim, d_state, dtype=torch.float32)
    p = torch.arange(headdim)
    for h in range(nheads):
        g = h // ratio
        hg = int((h % ratio >= head_range[g]).sum())
        dg = (p[:, None] >= dim_range[g, hg][None, :]).sum(-1)
        ok = dg < ndg
        out[h, ok] = table[g, hg, dg[ok]].to(torch.float32)
    return out


def dequantize_q2_state(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``state_scale_load * float(code)`` (selective_state_update.py:322): codes (batch, nheads, headdim, N)."""
    return scales.to(torch.float32) * codes.to(torch.float32)


def requantize_q2_state(h: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The kernel's re-quantization of the new state (selective_state_update.py:355):
    sat8(RNE(f32(h * 1e6) / f32(scale * 1e6))); h (batch, nheads, headdim, N) fp32 -> int8 codes."""
    mul = torch.tensor(REQUANT_MUL, dtype=torch.float32)
    num = h.to(torch.float32) * mul
    den = scales.to(torch.float32) * mul
    return round_half_even(num / den).clamp(-128, 127).to(torch.int8)


def handover_q2_state(h: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The prefill's final state as the first step's codes: rounded to fp16 by the state passing, then the
    same 1e6 rule (quant_ssd_combined.py:148-162, quant_ssm_states.py:111-117)."""
    return requantize_q2_state(round_to_dtype(h, torch.float16), scales)


def _step_dt(p: Q2SSDParams, q_dt: torch.Tensor) -> torch.Tensor:
    """dt = softplus(fma(dt_scale, q_dt, dt_bias)) per (batch, head) (selective_state_update.py:333-337)."""
    bias = p.dt_bias.to(torch.float16).to(torch.float32)
    return triton_softplus(fma_f32(torch.tensor(p.dt_scale, dtype=torch.float32), q_dt.to(torch.float32), bias))


def q2_state_update(p: Q2SSDParams, h: torch.Tensor, q_x: torch.Tensor, x_scales: torch.Tensor, q_dt: torch.Tensor,
                    *, q_B: torch.Tensor, B_scales: torch.Tensor, q_C: torch.Tensor,
                    C_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token of the kernel (module docstring) from the state's real values h (batch, nheads, headdim, N)
    fp32 (dequantize_q2_state of the codes). q_x: (batch, nheads, headdim) int8; x_scales: (nheads, headdim);
    q_dt: (batch, nheads) int8; q_B, q_C: (batch, ngroups, N) int8 with (ngroups,) scales.
    Returns (y (batch, nheads, headdim) fp16 values in fp32, the new fp32 state, dt (batch, nheads))."""
    nheads, ngroups = h.shape[1], q_B.shape[1]
    rep = nheads // ngroups
    x = x_scales.to(torch.float32) * q_x.to(torch.float32)                          # (b, h, p)
    dt = _step_dt(p, q_dt)                                                           # (b, h)
    A = -portable.exp(torch.tensor(p.A_log.scale, dtype=torch.float32) * p.A_log.codes.to(torch.float32))
    dA = portable.exp(A * dt)                                                        # (b, h)
    B = (B_scales[:, None] * q_B.to(torch.float32)).repeat_interleave(rep, dim=1)    # (b, h, N)
    C = (C_scales[:, None] * q_C.to(torch.float32)).repeat_interleave(rep, dim=1)
    D = torch.tensor(p.D.scale, dtype=torch.float32) * p.D.codes.to(torch.float32)  # (h,)
    dB = B * dt[..., None]                                                           # (b, h, N)
    new = fma_f32(h.to(torch.float32), dA[..., None, None], dB[:, :, None, :] * x[..., None])
    prods = new * C[:, :, None, :]
    y = prods[..., 0]
    for n in range(1, prods.shape[-1]):
        y = y + prods[..., n]
    y = fma_f32(x, D[:, None], y)
    return round_to_dtype(y, torch.float16), new, dt


def _scalar(fn, v: np.float32) -> np.float32:
    return np.float32(float(fn(torch.tensor([float(v)], dtype=torch.float32))[0]))


def q2_state_update_ref(p: Q2SSDParams, codes: torch.Tensor, scales: torch.Tensor, q_x: torch.Tensor,
                        x_scales: torch.Tensor, q_dt: torch.Tensor, *, q_B: torch.Tensor, B_scales: torch.Tensor,
                        q_C: torch.Tensor, C_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Oracle of dequantize_q2_state -> q2_state_update -> requantize_q2_state: the kernel's program written
    out per (batch, head, channel, state) in scalar fp32 (exact FMAs). Returns (y, new codes, the fp32 state')."""
    f = np.float32
    bsz, nheads, headdim, N = codes.shape
    rep = nheads // q_B.shape[1]
    y = torch.empty(bsz, nheads, headdim, dtype=torch.float32)
    q = torch.empty_like(codes)
    states = torch.empty(bsz, nheads, headdim, N, dtype=torch.float32)
    for b in range(bsz):
        for h in range(nheads):
            g = h // rep
            dt = fma_f32_exact(f(p.dt_scale), f(int(q_dt[b, h])), f(float(p.dt_bias[h].to(torch.float16))))
            if dt <= f(20.0):
                dt = _scalar(portable.log, f(_scalar(portable.exp, dt) + f(1.0)))
            A = -_scalar(portable.exp, f(f(p.A_log.scale) * f(int(p.A_log.codes[h]))))
            dA = _scalar(portable.exp, f(A * dt))
            D = f(f(p.D.scale) * f(int(p.D.codes[h])))
            for d in range(headdim):
                x = f(f(x_scales[h, d]) * f(int(q_x[b, h, d])))
                acc = None
                for n in range(N):
                    s = f(scales[h, d, n])
                    state = f(s * f(int(codes[b, h, d, n])))
                    dB = f(f(f(B_scales[g]) * f(int(q_B[b, g, n]))) * dt)
                    new = fma_f32_exact(state, dA, f(dB * x))
                    states[b, h, d, n] = float(new)
                    r = float(np.rint(f(f(new * f(REQUANT_MUL)) / f(s * f(REQUANT_MUL)))))
                    q[b, h, d, n] = int(min(127.0, max(-128.0, r)))
                    prod = f(new * f(f(C_scales[g]) * f(int(q_C[b, g, n]))))
                    acc = prod if acc is None else f(acc + prod)
                y[b, h, d] = float(np.float16(fma_f32_exact(x, D, acc)))
    return y, q, states
