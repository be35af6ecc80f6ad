"""Quamba2's quantized embedding and lm_head (the recipe knobs ``embedding`` and ``lm_head``, docs/modes.md
"Embedding and lm_head"), as quantize_fp16_model applies them with --quantize_embedding / --quantize_lm_head
(enyac-group/Quamba c474646 quamba/modelutils_mamba.py:615-660).

Embedding (the rotated fp16 table, rows independent, so quantizing the looked-up rows is quantizing the table):
* int8, W8O16Embedding.from_fp16 (qEmbedding.py:81-91): kernels.quant.quantize_rows_signed_max_fp16;
* int4, W4O16Embedding.from_fp16 (qEmbedding.py:26-47): s = f16(max(row) / 8) (the row's signed max, not max|row|,
  as written), q = clamp(round(f16(f16(e / s) + 8)), 0, 15) (torch.round: half to even);
the lookup (csrc/embedding/quant_embedding_kernel.cuh:75-78 int8, :139-165 int4 with the -8 folded in) returns
f16(s * (q - zero)): the product of a small integer and an fp16 scale is exact in fp32, so fp16 of the fp32
product is the fp16 multiply.

lm_head W8A8 (modelutils_mamba.py:649-655): norm_f becomes QRMSNorm at the lm_head:input scale and lm_head
W8A8B16O16Linear.from_fp16 (qLinearLayer.py:771-785): per-tensor absmax int8 weight (kernels.quant.quantize_weight_fp16),
alpha = (f32(s_w) * s_in).item(), an int8 GEMM times alpha, fp16 output (runner.head.Head).

lm_head W4 (a checkpoint's W4A16B16O16Linear or W4A8B16O16Linear, recipes.quamba.w4.checkpoint_head): the Marlin / Marlin-QQQ
GEMM of kernels.w4_linear on norm_f's fp16 output (W4A16) or its int8 codes at the lm_head:input scale (W4A8), fp16 logits;
``w4_lm_head_logits`` runs it a slice of the vocabulary at a time (the output rows are independent).

lm_head W4 of a mode (knob lm_head=quantized with int4 weights, ``w4_lm_head``): quantize_fp16_model's
``W4A16B16O16Linear.from_fp16(model.lm_head)`` (modelutils_mamba.py:650-652) or ``W4A8B16O16Linear.from_fp16(
model.lm_head, act_scales[-1]["lm_head:input"])`` (:653-657; W4AX hard-codes the latter, :740-743), on a head
that GPTQ did not touch: ``from_fp16`` then finds no ``apply_gptq`` on it (qLinearLayer.py:46-54, 175-183) and
Marlin's / Marlin-QQQ's own round to nearest quantizes the fp16 weight (marlin_utils.py:139-192, 304-346; the channel
scale from_fp16 computes, qLinearLayer.py:195-197, is not used: w4a8_quantize only takes it with a group scale,
marlin_utils.py:209-210): kernels.int4.rtn_int4. NOT upstream's ``--apply_gptq`` head: apply_gptq also runs GPTQ
on lm_head, in fp16 (``fasterquant(..., dtype=torch.float16)``, modelutils_mamba.py:478-507), and from_fp16 then
packs GPTQ's codes and group scales; the harness's GPTQ (float32) does not reproduce that fp16 run, so the W4 heads
here are the round-to-nearest ones (docs/modes.md "Embedding and lm_head").
"""
from __future__ import annotations

import torch

from ..spec import QTensor
from .int4 import Int4Weight, rtn_int4
from .w4_linear import w4a8_linear, w4a16_linear
from .quant import quantize_rows_signed_max_fp16, quantize_weight_fp16, round_to_dtype
from .rounding import round_half_even

__all__ = ["quantize_rows_int4_fp16", "quantized_rows", "w8a8_lm_head", "w4_lm_head", "w4_lm_head_logits"]

_INT4_ZERO = 8  # 2**(num_bits - 1) (qEmbedding.py:34)


def quantize_rows_int4_fp16(e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W4O16Embedding.from_fp16's codes (unpacked, 0..15, zero point 8) and fp16 per-row scales of (rows, d) fp16
    values (module docstring). A row with max 0 has scale 0: its 0/0 (NaN) entries become the zero code here."""
    e16 = e.to(torch.float16)
    s = e16.amax(dim=-1, keepdim=True) / _INT4_ZERO  # max_val / 2 = 16 / 2 (qEmbedding.py:35)
    shifted = (e16 / s) + _INT4_ZERO  # fp16 arithmetic, as the fp16 table's ops
    q = torch.nan_to_num(round_half_even(shifted).to(torch.float32), nan=float(_INT4_ZERO)).clamp(0, 2 * _INT4_ZERO - 1)
    return q.to(torch.int8), s.flatten()


def quantized_rows(rows: torch.Tensor, kind: str) -> torch.Tensor:
    """The embedding rows (..., d) fp32 holding fp16 values as the quantized table returns them: kind "int8"
    (W8O16Embedding) or "int4" (W4O16Embedding); fp32 holding fp16 values."""
    flat = rows.reshape(-1, rows.shape[-1])
    if kind == "int8":
        codes, scales = quantize_rows_signed_max_fp16(flat)
        values = codes.to(torch.float32)
    elif kind == "int4":
        codes, scales = quantize_rows_int4_fp16(flat)
        values = codes.to(torch.float32) - _INT4_ZERO
    else:
        raise ValueError(f"embedding {kind!r}: valid int8, int4")
    out = round_to_dtype(values * scales.to(torch.float32)[:, None], torch.float16)
    return out.reshape(rows.shape)


def w8a8_lm_head(w_fp16: torch.Tensor, s_in: float) -> tuple[QTensor, float]:
    """W8A8B16O16Linear.from_fp16 of the (vocab, d_model) fp16 head at input scale s_in: (int8 weight, alpha)."""
    w = quantize_weight_fp16(w_fp16)
    return w, (torch.tensor(w.scale, dtype=torch.float32) * s_in).item()


def w4_lm_head(w_fp16: torch.Tensor, a8: bool) -> Int4Weight:
    """The (vocab, d_model) fp16 head as W4A8B16O16Linear.from_fp16 (a8: Marlin-QQQ codes, fused group scales and
    fp32 channel scales) or W4A16B16O16Linear.from_fp16 (Marlin codes, fp16 group scales) quantize it (module
    docstring)."""
    return rtn_int4(w_fp16, channel=a8)


def w4_lm_head_logits(x: torch.Tensor | QTensor, w: Int4Weight, rows: int = 8192) -> torch.Tensor:
    """(..., d_model) norm_f output -> (..., vocab) fp32 holding fp16 logits: W4A16 (w without channel scales, x fp16
    values) or W4A8 (x a QTensor of int8 codes at the lm_head:input scale), `rows` output rows at a time."""
    parts = []
    for a in range(0, w.shape[0], rows):
        part = Int4Weight(w.codes[a:a + rows], w.group_scales[a:a + rows],
                          None if w.channel_scales is None else w.channel_scales[a:a + rows], w.group_size)
        parts.append(w4a8_linear(x, part, False) if isinstance(x, QTensor) else w4a16_linear(x, part))
    return torch.cat(parts, dim=-1)
