"""Quamba2 W8A8 weights of a Mamba-2 block's in_proj and conv1d (enyac-group/Quamba c474646).

Both quantize their fp16 weight split by split, each split per tensor with
``quantize_tensor_per_tensor_absmax`` (quamba/quant_utils.py:16-27: s = max(max|w|, 1e-5) / 127 in the
weight's dtype, codes clamp(round(w / s))), which is kernels.quant.quantize_weight_fp16:

* in_proj (``W8A8B8O8LinearParallel.from_fp16``, quamba/qLinearLayer.py:676-713): rows split as
  ``out_split_dims`` (z | x | B | C | dt), and each output column's factor b = s_w(split) / s_out(split),
  a Python double stored as fp32 (:698, :709-711); the rows padded to a multiple of 16 get b = 0 (:701-703;
  the padding is not kept here, it never reaches an output);
* conv1d (``Quamb2Conv1D.from_fp16``, quamba/qConvLayer.py:240-271): weight (conv_dim, K) and bias split
  as x | B | C, each with its own scale, **in fp32**: both are cast ``.to(torch.float32)`` before the absmax
  (:240, :256), so the scale and the division are fp32 (kernels.quant.quantize_param_fp32), not fp16 as in_proj.
"""
from __future__ import annotations

import torch

from ....kernels.quant import f32, quantize_param_fp32, quantize_weight_fp16

__all__ = ["q2_in_proj_weight", "q2_conv_weights"]


def _splits(w: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    assert sum(sizes) == w.shape[0], f"split sizes {sizes} do not add up to {w.shape[0]} rows"
    return list(torch.split(w, sizes, dim=0))


def q2_in_proj_weight(w: torch.Tensor, sizes: list[int],
                      out_scales: list[float]) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    """w: (n, d_model) fp16 values; sizes: rows per split; out_scales: each split's output scale.
    Returns (codes (n, d_model) int8, b (n,) fp32, the splits' weight scales)."""
    assert len(sizes) == len(out_scales), "one output scale per split"
    codes, b, w_scales = [], [], []
    for part, size, s_out in zip(_splits(w, sizes), sizes, out_scales):
        q = quantize_weight_fp16(part)
        codes.append(q.codes)
        w_scales.append(q.scale)
        b.extend([f32(q.scale / s_out)] * size)
    return torch.cat(codes), torch.tensor(b, dtype=torch.float32), w_scales


def q2_conv_weights(weight: torch.Tensor, bias: torch.Tensor | None, x_dim: int, bc: int):
    """weight: (conv_dim, K) fp16 values (quantized in fp32, qConvLayer.py:240); bias: (conv_dim,) or None; bc = ngroups * d_state.
    Returns (weight codes, (wx, wB, wC) scales, bias codes or None, (bx, bB, bC) scales or None)."""
    sizes = [x_dim, bc, bc]
    wq = [quantize_param_fp32(p) for p in _splits(weight, sizes)]
    w_codes, w_scales = torch.cat([q.codes for q in wq]), tuple(q.scale for q in wq)
    if bias is None:
        return w_codes, w_scales, None, None
    bq = [quantize_param_fp32(p) for p in _splits(bias, sizes)]
    return w_codes, w_scales, torch.cat([q.codes for q in bq]), tuple(q.scale for q in bq)
