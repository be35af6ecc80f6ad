"""The grouped int8 causal conv1d of Quamba2's W8A8 Mamba-2 block, and the scales it quantizes x, B, C at.

Sources: enyac-group/Quamba at c474646.

conv1d (``Quamb2Conv1D``, quamba/qConvLayer.py:129-311; kernel csrc/causal_conv1d/
quamba2_conv1d_fwd_kernel.cuh:163-270), per channel c of x | B | C (conv_dim channels):

    acc  = sum_w float(W[c, w]) * float(xBC[t - (K-1) + w])        exact in fp32 (|acc| <= 4 * 2^14)
    v    = f32(s_w * s_in) * acc + s_b * float(bias[c])             one fp32 FMA (nvcc contracts it)
    v    = v / (1 + expf(-v))                                       SiLU (:244)
    q    = sat8(roundf(v / s_out[c]))                               roundf: half away from zero (:254-270)

with s_w, s_in, s_b the x, B or C split's weight, input and bias scales (:167-218), and s_out[c]: for
x channels the scale of the channel's (SSD group, head group, dim group), found through the stored
cumulative ranges (:174-197); for B and C one scale per SSD group (:206-217). The GPU's ``expf`` is
fast math; here kernels.portable's exp (the same bits on every CPU), so rare codes can differ by one.

"""
from __future__ import annotations

import numpy as np
import torch

from .conv1d import silu_kernel
from .portable import exp as portable_exp
from .quant import fma_f32
from .rounding import round_half_away

__all__ = ["x_channel_scales", "x_channel_scales_ref", "conv_out_scales", "q2_conv1d",
           "q2_conv1d_ref", "q2_conv1d_values", "q2_conv1d_quantize"]


def x_channel_scales(x_out_scales: torch.Tensor, head_group_range: torch.Tensor, dim_group_range: torch.Tensor,
                     x_dim: int, headdim: int) -> torch.Tensor:
    """The output scale of every x channel, looked up as the kernel does (quamba2_conv1d_fwd_kernel.cuh:174-197).

    x_out_scales: (ngroups, n_head_groups, n_dim_groups) fp32; head_group_range: (ngroups, n_head_groups)
    int32 cumulative head ends per SSD group; dim_group_range: (ngroups, n_head_groups, n_dim_groups) int32
    cumulative channel ends within a head. Returns (x_dim,) fp32; a channel outside every range gets 0
    (the kernel leaves scale_out at 0 there). All channels at once; x_channel_scales_ref is the loop.
    """
    ngroups, n_hg, n_dg = x_out_scales.shape
    group_size = x_dim // ngroups
    c = torch.arange(x_dim)
    g, head, dim = c // group_size, (c % group_size) // headdim, c % headdim
    h_end = head_group_range.to(torch.int64)[g]                              # (x_dim, n_hg)
    h_start = torch.cat([torch.zeros_like(h_end[:, :1]), h_end[:, :-1]], 1)
    in_h = (h_start <= head[:, None]) & (head[:, None] < h_end)              # the first match wins, as the loop
    hg = torch.where(in_h.any(1), in_h.to(torch.int8).argmax(1), n_hg)
    d_end = dim_group_range.to(torch.int64)[g, hg.clamp(max=n_hg - 1)]      # (x_dim, n_dg)
    d_start = torch.cat([torch.zeros_like(d_end[:, :1]), d_end[:, :-1]], 1)
    in_d = (d_start <= dim[:, None]) & (dim[:, None] < d_end)
    dg = in_d.to(torch.int8).argmax(1)
    found = (hg < n_hg) & in_d.any(1)
    out = x_out_scales.to(torch.float32)[g, hg.clamp(max=n_hg - 1), dg]
    return torch.where(found, out, torch.zeros((), dtype=torch.float32))


def x_channel_scales_ref(x_out_scales: torch.Tensor, head_group_range: torch.Tensor, dim_group_range: torch.Tensor,
                         x_dim: int, headdim: int) -> torch.Tensor:
    """Oracle of x_channel_scales: the kernel's lookup written out channel by channel."""
    ngroups = x_out_scales.shape[0]
    group_size = x_dim // ngroups
    out = torch.zeros(x_dim, dtype=torch.float32)
    for c in range(x_dim):
        g, head, dim = c // group_size, (c % group_size) // headdim, c % headdim
        h_start = 0
        for hg in range(head_group_range.shape[1]):
            h_end = int(head_group_range[g, hg])
            if h_start <= head < h_end:
                d_start = 0
                for dg in range(dim_group_range.shape[2]):
                    d_end = int(dim_group_range[g, hg, dg])
                    if d_start <= dim < d_end:
                        out[c] = x_out_scales[g, hg, dg]
                        break
                    d_start = d_end
                break
            h_start = h_end
    return out


def conv_out_scales(x_scales: torch.Tensor, B_scales: torch.Tensor, C_scales: torch.Tensor,
                    d_state: int) -> torch.Tensor:
    """Per-channel output scales of x | B | C: x's per channel (x_channel_scales), B's and C's per SSD group
    (each group's d_state channels). Returns (x_dim + 2 * ngroups * d_state,) fp32."""
    return torch.cat([x_scales.to(torch.float32), B_scales.to(torch.float32).repeat_interleave(d_state),
                      C_scales.to(torch.float32).repeat_interleave(d_state)])


def _per_channel(values: tuple[float, float, float], x_dim: int, bc: int) -> torch.Tensor:
    return torch.tensor([values[0]] * x_dim + [values[1]] * bc + [values[2]] * bc, dtype=torch.float32)


def q2_conv1d(xBC: torch.Tensor, in_scales: tuple[float, float, float], weight: torch.Tensor,
              w_scales: tuple[float, float, float], bias: torch.Tensor | None, b_scales: tuple[float, float, float],
              out_scales: torch.Tensor, *, x_dim: int) -> torch.Tensor:
    """The grouped int8 conv + SiLU of Quamba2 (module docstring).

    xBC: (batch, seqlen, conv_dim) int8 codes, x | B | C at in_scales (x, B, C); weight: (conv_dim, K) int8 at
    w_scales; bias: (conv_dim,) int8 at b_scales or None; out_scales: (conv_dim,) fp32 (conv_out_scales).
    Returns (batch, seqlen, conv_dim) int8 codes.
    """
    return q2_conv1d_quantize(q2_conv1d_values(xBC, in_scales, weight, w_scales, bias, b_scales, x_dim=x_dim),
                              out_scales)


def q2_conv1d_quantize(v: torch.Tensor, out_scales: torch.Tensor) -> torch.Tensor:
    """The kernel's output quantizer: sat8(roundf(v / s_out[c])) (quamba2_conv1d_fwd_kernel.cuh:254-270)."""
    return round_half_away(v / out_scales.to(torch.float32)).clamp(-128, 127).to(torch.int8)


def q2_conv1d_values(xBC: torch.Tensor, in_scales: tuple[float, float, float], weight: torch.Tensor,
                     w_scales: tuple[float, float, float], bias: torch.Tensor | None,
                     b_scales: tuple[float, float, float], *, x_dim: int) -> torch.Tensor:
    """The fp32 conv + SiLU values that q2_conv1d's quantizer sees (arguments as q2_conv1d's)."""
    conv_dim, K = weight.shape
    bc = (conv_dim - x_dim) // 2
    xq, wq = xBC.to(torch.float32), weight.to(torch.float32)
    acc = torch.zeros_like(xq)
    for w in range(K):  # the kernel's tap order; every partial sum is an exact integer in fp32
        shift = K - 1 - w
        shifted = torch.nn.functional.pad(xq, (0, 0, shift, 0))[:, : xq.shape[1]] if shift else xq
        acc += wq[:, w] * shifted
    s_in = torch.tensor([float(np.float32(np.float32(sw) * np.float32(sx))) for sw, sx in zip(w_scales, in_scales)])
    scale_in = _per_channel(tuple(s_in.tolist()), x_dim, bc)
    bias_term = torch.zeros(conv_dim, dtype=torch.float32) if bias is None else \
        _per_channel(b_scales, x_dim, bc) * bias.to(torch.float32)
    return silu_kernel(fma_f32(scale_in, acc, bias_term))


def q2_conv1d_ref(xBC: torch.Tensor, in_scales: tuple[float, float, float], weight: torch.Tensor,
                  w_scales: tuple[float, float, float], bias: torch.Tensor | None, b_scales: tuple[float, float, float],
                  out_scales: torch.Tensor, *, x_dim: int) -> torch.Tensor:
    """Oracle of q2_conv1d: the kernel's loops written out per (batch, token, channel) on numpy float32 scalars
    (the FMA as an exact float64 product plus the addend, rounded to fp32; exp from kernels.portable)."""
    b, L, conv_dim = xBC.shape
    K = weight.shape[1]
    bc = (conv_dim - x_dim) // 2
    x, w = xBC.numpy(), weight.numpy()
    section = lambda c: 0 if c < x_dim else (1 if c < x_dim + bc else 2)  # noqa: E731
    out = np.zeros((b, L, conv_dim), dtype=np.int8)
    for c in range(conv_dim):
        s = section(c)
        scale_in = np.float32(np.float32(w_scales[s]) * np.float32(in_scales[s]))
        bias_val = np.float32(0.0) if bias is None else np.float32(np.float32(b_scales[s]) * np.float32(int(bias[c])))
        s_out = np.float32(out_scales[c])
        for n in range(b):
            for t in range(L):
                tmp = np.float32(0.0)
                for k in range(K):
                    src = t - (K - 1) + k
                    tmp = np.float32(tmp + np.float32(int(w[c, k])) * np.float32(int(x[n, src, c]) if src >= 0 else 0))
                v = np.float32(float(scale_in) * float(tmp) + float(bias_val))
                e = np.float32(portable_exp(torch.tensor([-v], dtype=torch.float32)).item())
                v = np.float32(v / np.float32(np.float32(1.0) + e))
                r = float(v / s_out)
                q = np.sign(r) * np.floor(abs(r) + 0.5)
                out[n, t, c] = int(min(127.0, max(-128.0, q)))
    return torch.from_numpy(out)
