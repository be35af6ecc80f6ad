"""The int4 weight of Quamba2's W4A8 and W4A16 linears, as codes and scales before Marlin packs them.

GPTQ (enyac-group/Quamba c474646 quamba/gptq_utils.py:65-85, group 128) gives each output channel's group of
128 input columns a float32 scale ``amax * 2/15`` and codes ``clamp(round(w / scale) + 8, 0, 15)``; Marlin
(W4A16) stores the codes packed with fp16 group scales, Marlin-QQQ (W4A8) stores fp16 group scales divided
by an fp32 per-output-channel scale (quamba/marlin_utils.py:221-279). This container holds what both
share, unpacked: the producer (GPTQ on CPU, or a Quamba2 checkpoint's Marlin tensors unpacked) fills it,
the W4 linears read it.

``rtn_int4``: Marlin's own round-to-nearest int4 quantizer, for the weight of a linear GPTQ did not touch (Mamba-1's
x_proj).

Source: enyac-group/Quamba at c474646. Quamba's ``apply_gptq`` runs GPTQ on in_proj and out_proj only
(quamba/modelutils_mamba.py:443-450); ``W4A16QMamba`` and ``W4A8QMamba`` also hold x_proj as an int4 Marlin linear
(quamba/qMambaLayer.py:357, 611-616), whose ``from_fp16`` finds no GPTQ scale on it and quantizes the fp16 weight
itself (qLinearLayer.py:42-76, 312-360), on the CPU (``W.cpu()``), with torch's fp16 arithmetic:

* W4A16, ``get_w4a16_quantize_weights`` (marlin_utils.py:304-346), per group of 128 input columns:
  ``s = fp16(max|w|) *= 2/15`` (an fp16 tensor), codes ``clamp(round(fp16(w / s)) + 8, 0, 15)``; Marlin keeps
  ``s`` as the fp16 group scale.
* W4A8, ``get_w4a8_quantize_weights`` (marlin_utils.py:139-192): the same codes and group scale, then the
  dequantized ``w_ref = fp16((code - 8) * s)``, the channel scale ``fp16(max|w_ref|) /= 127`` (fp16) held in
  fp32, and the group scales fused as ``fp16(s / s_channel)`` (fp32 division).

Widths: Quamba takes group 128 above 128 input columns and its per-channel scheme at 128 or fewer
(qLinearLayer.py:46, 319); a width above 128 that is not a multiple of 128 does not reshape in Marlin. As for
GPTQ (emulation.gptq), the harness then uses one group per row with this quantizer (docs/fidelity.md).
A NaN code (0 / 0, an all-zero group) becomes 0, as torch's CPU cast and the clamp give; a NaN fused scale
(an all-zero row) becomes 0, the row's value either way.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .rounding import round_half_even

__all__ = ["ZERO_POINT", "Int4Weight", "rtn_group_size", "rtn_int4"]

ZERO_POINT = 8  # the uint4 code that means 0 (gptq_utils.py:65-85; marlin_utils.py)


@dataclass(frozen=True)
class Int4Weight:
    """codes: uint8 [out, in] in 0..15 (value ∝ code - 8); group_scales: float16 [out, in // group_size];
    channel_scales: float32 [out] for Marlin-QQQ (W4A8), None for Marlin (W4A16)."""

    codes: torch.Tensor
    group_scales: torch.Tensor
    channel_scales: torch.Tensor | None
    group_size: int = 128

    def __post_init__(self) -> None:
        out, inp = self.codes.shape
        if self.codes.dtype != torch.uint8 or int(self.codes.max()) > 15:
            raise ValueError("Int4Weight.codes must be uint8 in 0..15")
        if inp % self.group_size:
            raise ValueError(f"in_features {inp} is not a multiple of the group size {self.group_size}")
        if tuple(self.group_scales.shape) != (out, inp // self.group_size):
            raise ValueError(f"group_scales has shape {tuple(self.group_scales.shape)}, "
                             f"expected {(out, inp // self.group_size)}")
        if self.channel_scales is not None and tuple(self.channel_scales.shape) != (out,):
            raise ValueError(f"channel_scales has shape {tuple(self.channel_scales.shape)}, expected {(out,)}")

    def info(self) -> dict:
        """What the stats record of the weight: its group size, the sum of its codes, its largest group scale."""
        return {"group_size": self.group_size, "codes_sum": int(self.codes.to(torch.int64).sum()),
                "group_scale_max": float(self.group_scales.to(torch.float32).max())}

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]


_MAXQ = 15


def rtn_group_size(in_features: int) -> int:
    """128, or in_features when it is not a multiple of 128 (module docstring)."""
    return 128 if in_features % 128 == 0 else in_features


def rtn_int4(weight: torch.Tensor, channel: bool) -> Int4Weight:
    """weight: (out, in) fp16 values (any float dtype) -> Marlin's (channel=False) or Marlin-QQQ's (channel=True)
    Int4Weight of it, before any output scale is fused (module docstring)."""
    out_dim, in_dim = weight.shape
    g = rtn_group_size(in_dim)
    w = weight.to(torch.float16).reshape(out_dim, in_dim // g, g)
    s = w.abs().amax(dim=2, keepdim=True)
    s *= 2 / _MAXQ                                             # fp16 tensor, as marlin_utils.py:164, 329
    q = round_half_even(w / s)                                 # fp16 quotient, torch.round: half to even
    q = torch.where(torch.isnan(q), torch.full_like(q, -ZERO_POINT), q)
    codes = (q.to(torch.int32) + ZERO_POINT).clamp(0, _MAXQ)
    s16 = s.squeeze(2)
    codes8 = codes.reshape(out_dim, in_dim).to(torch.uint8)
    if not channel:
        return Int4Weight(codes8, s16, None, g)
    w_ref = (codes - ZERO_POINT).to(torch.float16) * s         # marlin_utils.py:171
    s_ch = w_ref.abs().amax(dim=(1, 2))
    s_ch /= 127.0                                              # fp16, marlin_utils.py:184-185
    s_ch = s_ch.to(torch.float32)
    fused = torch.nan_to_num((s16.to(torch.float32) / s_ch.unsqueeze(1)).to(torch.float16), nan=0.0)
    return Int4Weight(codes8, fused, s_ch, g)
