"""Norms: Quamba2's gated RMSNorm of the Mamba-2 block (int8 z, fp16 output).

Sources: enyac-group/Quamba at c474646.

gated norm (``QRMSNormGated`` with use_float16_output=True, quamba/qMamba2.py:1152-1154, forward
quamba/qNorm.py:145-166; Triton kernel quamba/triton/quant_normgated.py:35-71), per token and per group
of d_ssm / ngroups channels (norm_before_gate=False):

    x   = float(y);  z = float(q_z) * z_scale;  x = x * (z * sigmoid(z))     (:47-50)
    var = sum(x * x) / N;  rstd = 1 / sqrt(var + eps)                       (:56-58)
    out = f16((x * rstd) * float(w))                                       (:61-71)

The Triton reduction's order is not reproduced: the sum is kernels.portable's fixed pairwise order.
"""
from __future__ import annotations

import numpy as np
import torch

from . import portable

__all__ = ["q2_gated_norm", "q2_gated_norm_ref"]


def q2_gated_norm(y: torch.Tensor, z_codes: torch.Tensor, z_scale: float, weight: torch.Tensor, ngroups: int,
                  eps: float) -> torch.Tensor:
    """Quamba2's gated RMSNorm (module docstring). y: (..., d_ssm) fp16 values (the SSD's output); z_codes:
    (..., d_ssm) int8 at z_scale (in_proj's z); weight: (d_ssm,) fp16 values. Returns (..., d_ssm) fp16 values
    (held in fp32)."""
    z = z_codes.to(torch.float32) * torch.tensor(z_scale, dtype=torch.float32)
    x = y.to(torch.float32) * (z * portable.sigmoid(z.contiguous()))
    *lead, d = x.shape
    g = x.reshape(*lead, ngroups, d // ngroups)
    var = portable.mean_last(g * g)
    rstd = 1.0 / portable.sqrt(var + torch.tensor(eps, dtype=torch.float32))
    out = (g * rstd).reshape(*lead, d) * weight.to(torch.float32)
    return out.to(torch.float16).to(torch.float32)


def q2_gated_norm_ref(y: torch.Tensor, z_codes: torch.Tensor, z_scale: float, weight: torch.Tensor, ngroups: int,
                      eps: float) -> torch.Tensor:
    """Oracle of q2_gated_norm in float64, one (token, group) at a time, rounded to fp16 once."""
    z = z_codes.double() * float(np.float32(z_scale))
    x = y.double() * z / (1.0 + torch.exp(-z))
    size = x.shape[-1] // ngroups
    parts = [x[..., k * size:(k + 1) * size] for k in range(ngroups)]
    normed = torch.cat([p / torch.sqrt(p.pow(2).mean(-1, keepdim=True) + float(np.float32(eps))) for p in parts], -1)
    return (normed * weight.double()).to(torch.float16).to(torch.float32)
