"""Weights of one Mamba-2 block as a float recipe needs them: rounded to fp32/fp16, folded and rotated.

The same offline transforms as Mamba-1 (harness.architectures.transforms, spec notes §2.1), placed as Quamba2
places them (Quamba c474646 quamba/qMamba2.py:113, 143-144, the float Mamba2Simple: in_proj's input
rotated, a Hadamard before out_proj; W8A8QMamba2.forward :1323-1332: gated norm, Hadamard, out_proj): the
block's RMSNorm weight folds into in_proj's columns and in_proj's rows take Had_D^T (so the rotated
residual stream Had_D r enters it); out_proj becomes Had_D W_out Had_E^T, E = d_inner, the online
Hadamard after the gated norm supplying Had_E. The gated norm's own weight is not folded (it stays a
per-channel multiply before the Hadamard). A_log takes the model's dtype and D stays fp32, as mamba_ssm's
Mamba2 creates them (enyac-group/mamba f034308 mamba_ssm/modules/mamba2.py:131-137: ``A_log = torch.log(A)
.to(dtype=dtype)``, ``D = torch.ones(...)`` in fp32; the checkpoint's values are copied into those parameters
uncast, since ``load_state_dict_hf`` returns before its own cast, mamba_ssm/utils/hf.py:14-18): in Quamba's fp16
model, A_log holds fp16 values and D full-precision fp32 ones (Mamba-1's Mamba creates both fp32,
harness.architectures.mamba1.weights).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernels.quant import round_to_dtype
from ..transforms import rotated_projections

__all__ = ["Mamba2Params", "float_layer_mamba2"]


@dataclass
class Mamba2Params:
    """Prepared parameters of one Mamba-2 block; fp32 tensors holding values of their dtype.

    in_proj: (2*d_inner + 2*ngroups*d_state + nheads, d_model), rows [z | xBC | dt];
    conv_weight: (conv_dim, d_conv); conv_bias: (conv_dim,) or None; dt_bias, A_log, D: (nheads,);
    gnorm_weight: (d_inner,); out_proj: (d_model, d_inner); norm_weight: (d_model,) or None (folded).
    """

    norm_weight: torch.Tensor | None
    in_proj: torch.Tensor
    conv_weight: torch.Tensor
    conv_bias: torch.Tensor | None
    dt_bias: torch.Tensor
    A_log: torch.Tensor
    D: torch.Tensor
    gnorm_weight: torch.Tensor
    out_proj: torch.Tensor


def float_layer_mamba2(raw: dict[str, torch.Tensor | None], rotate: bool, dtype: torch.dtype) -> Mamba2Params:
    """raw: fp32 tensors of the checkpoint (checkpoints.loading.Checkpoint.raw_layer of a Mamba-2 model)."""
    def rnd(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else round_to_dtype(t, dtype)

    in_proj, out_proj, norm_weight = rotated_projections(raw, rotate, rnd)
    return Mamba2Params(
        norm_weight=norm_weight, in_proj=in_proj, conv_weight=rnd(raw["conv_weight"]), conv_bias=rnd(raw["conv_bias"]),
        dt_bias=rnd(raw["dt_bias"]), A_log=rnd(raw["A_log"]), D=raw["D"].to(torch.float32),
        gnorm_weight=rnd(raw["gnorm_weight"]), out_proj=out_proj)
