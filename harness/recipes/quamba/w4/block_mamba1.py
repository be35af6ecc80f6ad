"""Quamba2's W4A8 and W4A16 Mamba-1 blocks (enyac-group/Quamba c474646 quamba/qMambaLayer.py).

Quamba2 quantizes a Mamba-1 model with ``configure_model``'s "mamba" branch (modelutils_mamba.py:58-81: the
fp16 embedding and lm_head rotated, the block norm folded into in_proj, ``MambaSimple`` with its Hadamards),
Quamba1's preparation (prep=quamba), then ``run_quamba_calibration`` (:112-233; head grouping raises
NotImplementedError for Mamba-1, :240-241), so its W8A8 scales are mode 0's; GPTQ runs on in_proj and out_proj
(:443-465, recipes.quamba.w4.gptq_mamba1); the mixers (:537-561):

* W4A8, ``W4A8QMamba`` (qMambaLayer.py:512-757): ``W8A8QMamba`` (mode 0's block: QRMSNorm to int8, the int8
  conv, int8 dt_proj ``W8A8B8O8Linear``, ``QSScan``, ``QHadamard`` to int8) with Marlin-QQQ linears:
  in_proj and x_proj ``W4A8B8O8Linear`` (int8 out at ``in_proj:output`` = s_xz and ``x_proj:output`` = s_xp,
  each divided into the channel scales, marlin_utils.py:254-256; :593-615), out_proj ``W4A8B16O16Linear``
  (fp16 out, input scale s_H; :641-644). dt_proj stays W8A8 (:616-621: Marlin-QQQ has no K = dt_rank tile).
* W4A16, ``W4A16QMamba`` (qMambaLayer.py:230-510): the fp16 rotated block with Marlin ``W4A16B16O16Linear``
  in_proj, x_proj and out_proj (:345-367); the norm stays fp16 (modelutils_mamba.py:569); the conv is
  ``causal_conv1d_fn`` (fp16 in and out, SiLU fused, :399-404), dt_proj an fp16 matmul without its bias (:411),
  the scan mamba_ssm's ``selective_scan_fn`` with the fp32 bias (:418-430), the fp16 Hadamard (:436).

x_proj was not GPTQ'd: its int4 weight is Marlin's own round to nearest (kernels.int4).

The decode steps (``step``, qMambaLayer.py:695-719 and :440-462) are the prefill's linears on one token (Marlin
has no GEMV path) around mode 0's step (W4A8: int8 conv window, Quamba's int8 SSM state update, W8A8 dt_proj) or
the fp16 step (W4A16: ``causal_conv1d_update``, ``selective_state_update`` on an fp16 state, fp16 dt_proj).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ....spec import FloatOut, LayerScales, QTensor, Rounding
from .block_mamba2 import EmuW4A8Linear, EmuW4A16Linear
from ....emulation.modules import ConvInput, EmuConv1d, EmuMambaBlock
from ....kernels.int4 import Int4Weight
from ....kernels.int4 import rtn_int4
from ....kernels.w4_linear import qqq_int8_weight, w4a8_values
from ....kernels.quant import quantize_prescaled

__all__ = ["Q1W4Layer", "EmuW4A8O8Linear", "with_output_scale", "q1w4_layer", "with_w4a8_linears",
           "with_w4a16_linears"]


@dataclass(frozen=True)
class Q1W4Layer:
    """One Mamba-1 block's int4 linears as the kernels hold them (Marlin-QQQ for W4A8, with in_proj's and
    x_proj's output scales divided into their channel scales; Marlin for W4A16) and, for W4A8, mode 0's scales
    (None for W4A16)."""

    in_proj: Int4Weight
    x_proj: Int4Weight
    out_proj: Int4Weight
    scales: LayerScales | None

    def info(self) -> dict:
        return {"in_proj": self.in_proj.info(), "x_proj": self.x_proj.info(), "out_proj": self.out_proj.info(),
                **({"w8a8": self.scales.as_dict()} if self.scales is not None else {})}


class EmuW4A8O8Linear(nn.Module):
    """Marlin-QQQ ``W4A8B8O8Linear``: int8 in, int8 out at `scale` (``cvt.rni.s8``: half to even, saturating;
    the output scale is already divided into the weight's channel scales)."""

    def __init__(self, weight: Int4Weight, scale: float) -> None:
        super().__init__()
        self.weight, self.scale = weight, scale
        self._w8: torch.Tensor | None = None  # the kernel's int8 weight, made by the first call

    def forward(self, x: QTensor) -> QTensor:
        if self._w8 is None:
            self._w8 = qqq_int8_weight(self.weight)
        v = torch.nan_to_num(w4a8_values(x, self.weight, self._w8), nan=0.0)
        return quantize_prescaled(v, self.scale, Rounding.HALF_EVEN)

    step = forward  # one token: the same kernel with m = 1 (qLinearLayer.py:371-388)


def with_output_scale(w: Int4Weight, s_out: float) -> Int4Weight:
    """``w4a8_quantize(..., out_scales=)`` (marlin_utils.py:254-256): the channel scales / the output scale, fp32."""
    return Int4Weight(w.codes, w.group_scales, w.channel_scales / torch.tensor(s_out, dtype=torch.float32),
                      w.group_size)


def q1w4_layer(in_proj: Int4Weight, out_proj: Int4Weight, x_proj_fp16: torch.Tensor,
               scales: LayerScales | None) -> Q1W4Layer:
    """GPTQ's in_proj and out_proj (emulation.gptq.to_int4_weight), x_proj's fp16 weight quantized by Marlin's
    ``from_fp16`` (kernels.int4), and for W4A8 (scales given) the int8 outputs' scales fused."""
    x_proj = rtn_int4(x_proj_fp16, channel=scales is not None)
    if scales is None:
        return Q1W4Layer(in_proj, x_proj, out_proj, None)
    return Q1W4Layer(with_output_scale(in_proj, scales.s_xz), with_output_scale(x_proj, scales.s_xp),
                     out_proj, scales)


def with_w4a8_linears(block: EmuMambaBlock, w4: Q1W4Layer) -> EmuMambaBlock:
    """Mode 0's block (build.build_block) with the Marlin-QQQ in_proj, x_proj and out_proj."""
    assert w4.scales is not None, "a W4A8 block needs mode 0's scales"
    block.in_proj = EmuW4A8O8Linear(w4.in_proj, w4.scales.s_xz)
    block.x_proj = EmuW4A8O8Linear(w4.x_proj, w4.scales.s_xp)
    block.out_proj = EmuW4A8Linear(w4.out_proj, keep_int8=True)
    return block


def with_w4a16_linears(block: EmuMambaBlock, w4: Q1W4Layer) -> EmuMambaBlock:
    """The rotated fp16 block of Quamba's calibration model (build.build_block, calibration=True) as
    ``W4A16QMamba`` runs it: ``causal_conv1d_fn`` (SiLU on the fp32 sum, fp16 out) instead of the fp16 nn.Conv1d,
    and Marlin in_proj, x_proj and out_proj."""
    conv = block.conv1d
    block.conv1d = EmuConv1d(conv.weight, conv.bias, ConvInput("float"), FloatOut(torch.float16))
    block.in_proj, block.x_proj = EmuW4A16Linear(w4.in_proj), EmuW4A16Linear(w4.x_proj)
    block.out_proj = EmuW4A16Linear(w4.out_proj)
    return block
