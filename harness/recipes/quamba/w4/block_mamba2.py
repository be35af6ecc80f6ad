"""Quamba2's W4A8 and W4A16 Mamba-2 blocks (enyac-group/Quamba c474646 quamba/qMamba2.py).

* W4A8 (``W4A8QMamba2``, qMamba2.py:735-994): the W8A8 block (recipes.quamba.q2.block: int8 norm output, grouped
  int8 conv, quantized SSD, gated norm, online Hadamard to int8) with Marlin-QQQ linears: in_proj
  ``W4A8B8O8LinearParallel`` (int8 out, the split's output scale fused into the channel scale,
  qLinearLayer.py:454-502) and out_proj ``W4A8B16O16Linear`` (fp16 out, :172-215). Its scales are
  q2-w8a8's (Quamba calibrates and reorders before GPTQ, modelutils_mamba.py:801-833), its weights GPTQ's on
  the reordered, rotated fp16 model.
* W4A16 (``W4A16QMamba2``, qMamba2.py:381-639): the fp16 Mamba-2 (the block norm stays fp16,
  ``quantize_norm_fn`` returns it unchanged, modelutils_mamba.py:569; mamba_ssm's conv and SSD in fp16, the
  fp16 Hadamard) with Marlin ``W4A16B16O16Linear`` in_proj and out_proj (fp16 out). No calibration of
  activations and no reorder (modelutils_mamba.py:820-825); GPTQ on the rotated fp16 model.

The decode step (docs/decode.md "Mamba-2: the Quamba2 W4 steps"). ``W4A8QMamba2.step`` (qMamba2.py:997-1021) is
``W8A8QMamba2.step`` line for line (int8 conv window, Quamba2's int8 SSM state update) with its Marlin-QQQ
linears; ``W4A16QMamba2.step`` (:641-685) is mamba_ssm's fp16 step (``causal_conv1d_update``,
``selective_state_update``; fp16 conv and SSM caches, :687-699) with its Marlin linears. The Marlin linears have
no GEMV path: one token is the same kernel with m = 1 (``W4A16B16O16Linear.forward``, qLinearLayer.py:88-107;
``W4A8B16O16Linear.forward`` :228-248; ``W4A8B8O8LinearParallel.forward`` :514-533), the same epilogue and
output rounding as the prefill's (W4A8: int32 sums, exact whatever m; W4A16: the fp32 tensor-core sum, whose
order the harness does not reproduce either way), so the step runs the prefill's linear on one token.

``Q2W4Layer`` is what calibration hands to the build for one block: the int4 weights (and, for W4A8, the
W8A8 scales).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ....spec import Mamba2Dims, QTensor
from ....architectures.mamba2.block import EmuMamba2Block
from ..q2.block import EmuQ2Mamba2Block, build_q2_block
from ....kernels.int4 import Int4Weight
from ....kernels.w4_linear import qqq_int8_weight, w4a8_linear, w4a8_values, w4a16_linear
from ....kernels.quant import round_to_dtype
from ..q2.params import Q2Params, Q2Scales, q2_params

__all__ = ["Q2W4Layer", "EmuW4A8Linear", "EmuW4A16Linear", "EmuQ2W4A8Block", "build_q2w4a8_block",
           "with_w4a16_linears", "in_proj_out_scales"]


@dataclass(frozen=True)
class Q2W4Layer:
    """One block's int4 linears as the kernels hold them (Marlin-QQQ for W4A8: in_proj's channel scales with each
    split's output scale divided in, as a Quamba2 checkpoint stores them, recipes.quamba.w4.checkpoint_blocks; Marlin for
    W4A16) and, for W4A8, its W8A8 scales (None for W4A16)."""

    in_proj: Int4Weight
    out_proj: Int4Weight
    scales: Q2Scales | None

    def info(self) -> dict:
        return {"in_proj": self.in_proj.info(), "out_proj": self.out_proj.info(),
                **({"w8a8": self.scales.info()} if self.scales is not None else {})}


class EmuW4A16Linear(nn.Module):
    """Marlin W4A16: fp16 in, fp16 out (kernels.w4_linear.w4a16_linear)."""

    def __init__(self, weight: Int4Weight) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return w4a16_linear(x, self.weight)

    step = forward


class EmuW4A8Linear(nn.Module):
    """Marlin-QQQ W4A8B16O16: int8 in (its per-tensor scale is s_tok), fp16 out (kernels.w4_linear.w4a8_linear).
    keep_int8: hold the kernel's int8 weight after the first call (kernels.w4_linear.qqq_int8_weight, 60 % of a call's
    time at 130m's out_proj) instead of converting the int4 codes at every call; the same values either way."""

    def __init__(self, weight: Int4Weight, keep_int8: bool = False) -> None:
        super().__init__()
        self.weight, self.keep_int8 = weight, keep_int8
        self._w8: torch.Tensor | None = None

    def forward(self, x: QTensor) -> torch.Tensor:
        if not self.keep_int8:
            return w4a8_linear(x, self.weight, out_int8=False)
        if self._w8 is None:
            self._w8 = qqq_int8_weight(self.weight)
        return round_to_dtype(w4a8_values(x, self.weight, self._w8), torch.float16)

    step = forward   # one token: the same Marlin-QQQ kernel, m = 1 (qLinearLayer.py:228-248)


def in_proj_out_scales(w: Int4Weight, s: Q2Scales, dims: Mamba2Dims) -> Int4Weight:
    """``w4a8_quantize(..., out_scales=)`` (marlin_utils.py:254-256): s_channel / the split's output scale,
    z | x | B | C | dt (qMamba2.py:857-866), in fp32."""
    gs = dims.ngroups * dims.d_state
    out = torch.tensor([s.s_z] * dims.d_inner + [s.s_x] * dims.d_inner + [s.s_B] * gs + [s.s_C] * gs
                       + [s.s_dt] * dims.nheads, dtype=torch.float32)
    return Int4Weight(w.codes, w.group_scales, w.channel_scales / out, w.group_size)


class EmuQ2W4A8Block(EmuQ2Mamba2Block):
    """The q2-w8a8 block with the Marlin-QQQ in_proj (int8 codes of every split at its own scale)."""

    def set_in_proj(self, weight: Int4Weight) -> None:
        self.w4_in = weight

    def _in_proj(self, normed) -> torch.Tensor:
        return w4a8_linear(normed, self.w4_in, out_int8=True)

    def _step_in_proj(self, normed) -> torch.Tensor:
        """One token: the same ``w4a8o8_gemm`` with m = 1 (qLinearLayer.py:514-533), RNE and saturation, not
        W8A8's GEMV (its half-away roundf)."""
        return self._in_proj(normed)


def build_q2w4a8_block(layer: int, dims: Mamba2Dims, raw: dict | None, w4: Q2W4Layer, chunked: bool, *,
                       params: Q2Params | None = None, state_dtype: str = "int8") -> EmuQ2W4A8Block:
    """The W4A8 block: q2-w8a8's parts (recipes.quamba.q2.block.build_q2_block) with GPTQ's Marlin-QQQ linears;
    params: the activation path's tensors as a W4A8 checkpoint stores them, instead of raw's; state_dtype: the
    decode state (EmuQ2Mamba2Block.state_dtype; int8: the W8A8 calibration's ssm_state_scale, which W4A8 shares)."""
    s = w4.scales
    assert s is not None, "a W4A8 block needs the W8A8 scales"
    base = build_q2_block(layer, dims, q2_params(raw, s, dims) if params is None else params, s, chunked)
    block = EmuQ2W4A8Block(layer, dims, base.q, s, chunked=chunked, norm=base.norm, had=base.had,
                           out_proj=EmuW4A8Linear(w4.out_proj), state_dtype=state_dtype)
    block.set_in_proj(w4.in_proj)
    return block


def with_w4a16_linears(block: EmuMamba2Block, w4: Q2W4Layer) -> EmuMamba2Block:
    """The fp16 rotated Mamba-2 block (build.build_mamba2_block) with Marlin W4A16 in_proj and out_proj."""
    block.in_proj, block.out_proj = EmuW4A16Linear(w4.in_proj), EmuW4A16Linear(w4.out_proj)
    return block
