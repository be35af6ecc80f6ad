"""Quamba2's quantized SSD inputs, dequantized as its Triton kernels dequantize them, then the chunked SSD.

``Quamba2ChunkScan`` (enyac-group/Quamba c474646 quamba/qChunkScan.py:17-125) keeps A_log and D int8 with
per-tensor scales (:105-107, :119-121), dt_bias fp16 (:40, "we do not quant dt_bias"), and takes int8 dt,
x (per SSD group x head group x dim group scales), B and C (per SSD group). Inside the kernels:

    dt = softplus(f32(dt_scale * float(q_dt)) + float(dt_bias))    quamba/triton/quant_chunk_cumsum.py:56-61
    A  = -exp(f32(A_log_scale * float(q_A_log)))                   :67
    D  = f32(D_scale * float(q_D))                                 quamba/triton/quant_chunk_scan.py:152-154
    x  = x_scale(group, head group, dim group) * float(q_x)        :358-381
    B, C = scale(SSD group) * float(code)

after which the kernels compute the SSD with fp16 ``tl.dot`` on tiles whose size autotuning picks: not
reproduced here. ``q2_ssd`` runs kernels.ssd.ssd_chunked (fp32) on the dequantized values: the SSD as Quamba2
quantizes its inputs, with float arithmetic after that (docs/fidelity.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..spec import QTensor
from .ssd import ssd_chunked, ssd_dt

__all__ = ["Q2SSDParams", "q2_ssd_inputs", "q2_ssd"]


@dataclass(frozen=True)
class Q2SSDParams:
    """A_log, D: (nheads,) int8 at their scales; dt_bias: (nheads,) fp16 values; dt_scale: dt's input scale."""

    A_log: QTensor
    D: QTensor
    dt_bias: torch.Tensor
    dt_scale: float
    chunk_size: int


def _deq(codes: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    s = scale if isinstance(scale, torch.Tensor) else torch.tensor(scale, dtype=torch.float32)
    return s.to(torch.float32) * codes.to(torch.float32)


def q2_ssd_inputs(p: Q2SSDParams, q_x: torch.Tensor, x_scales: torch.Tensor, q_dt: torch.Tensor, *,
                  q_B: torch.Tensor, B_scales: torch.Tensor, q_C: torch.Tensor, C_scales: torch.Tensor) -> dict:
    """Real values of the SSD's inputs. q_x: (batch, seqlen, nheads, headdim) int8; x_scales: (nheads * headdim,)
    per channel (kernels.conv1d_grouped.x_channel_scales); q_dt: (batch, seqlen, nheads) int8; q_B, q_C: (batch, seqlen,
    ngroups, d_state) int8 with (ngroups,) scales. Returns x, dt (after softplus), A_log, B, C, D (fp32)."""
    b, L, h, hd = q_x.shape
    x = _deq(q_x, x_scales.reshape(h, hd))
    dt = ssd_dt(_deq(q_dt, p.dt_scale), p.dt_bias.to(torch.float16).to(torch.float32))
    return {"x": x, "dt": dt, "A_log": _deq(p.A_log.codes, p.A_log.scale), "B": _deq(q_B, B_scales[:, None]),
            "C": _deq(q_C, C_scales[:, None]), "D": _deq(p.D.codes, p.D.scale)}


def q2_ssd(p: Q2SSDParams, q_x: torch.Tensor, x_scales: torch.Tensor, q_dt: torch.Tensor, *, q_B: torch.Tensor,
           B_scales: torch.Tensor, q_C: torch.Tensor, C_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """y (batch, seqlen, nheads, headdim) and the final state, the chunked SSD on q2_ssd_inputs."""
    v = q2_ssd_inputs(p, q_x, x_scales, q_dt, q_B=q_B, B_scales=B_scales, q_C=q_C, C_scales=C_scales)
    return ssd_chunked(v["x"], v["dt"], v["A_log"], v["B"], v["C"], v["D"], p.chunk_size)
