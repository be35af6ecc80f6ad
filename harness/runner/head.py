"""The final RMSNorm and lm_head of a mode (``Head``), prepared once per run and shared between the modes that
use the same weights (``build_head``, ``keep_only``); the rotation and rounding of the head itself:
runner.headprep."""
from __future__ import annotations

import weakref
from dataclasses import replace

import torch
from torch import nn

from ..emulation.build import act_dtype
from ..emulation.modules import EmuRMSNorm
from ..kernels.linear import float_linear, int8_gemm
from ..kernels.quant import dequantize, round_to_dtype, to_output
from ..kernels.int4 import Int4Weight
from ..kernels.embedding_head import w4_lm_head, w4_lm_head_logits, w8a8_lm_head
from ..modes import LmHead, ModeRecipe, Rotate, Weights
from ..runtime.memory import release_freed
from ..spec import FLOAT_DTYPES, FloatOut, QTensor, QuantOut, Rounding
from .headprep import rotated_head, round_rows_
from .weightbank import WeightBank, lm_head_weight

__all__ = ["Head", "build_head", "keep_only"]


class Head(nn.Module):
    """Final RMSNorm and lm_head: residual (batch, seq, d_model) fp32 -> logits (batch, seq, vocab) fp32.

    Float recipes (the Quamba1 recipe keeps both in floating point): the norm in fp32 arithmetic
    with its weight, lm_head in the recipe's weight dtype (fp16 for int8 weights), output rounded
    to act_dtype. Rotated recipes fold norm_f's weight into lm_head and rotate it (as the blocks,
    modelutils_mamba.py:64-70). A Quamba checkpoint's W8A8B16O16Linear lm_head: norm_f output
    quantized at its output scale (RNE), int8 GEMM, times the stored fp32 alpha, fp16 output. A Quamba2 W4
    checkpoint's W4A16B16O16Linear / W4A8B16O16Linear (an Int4Weight): the Marlin GEMM (kernels.embedding_head);
    lm_head=quantized of q2-w4a16 / q2-w4a8 / q2-w4ax builds the same from the mode's own fp16 head.
    """

    def __init__(self, norm: EmuRMSNorm, weight: torch.Tensor | QTensor | Int4Weight, out: FloatOut,
                 alpha: float | None = None):
        super().__init__()
        self.norm, self.weight, self.out, self.alpha = norm, weight, out, alpha

    @torch.no_grad()
    def forward(self, residual: torch.Tensor) -> torch.Tensor:
        x = self.norm(residual)
        if isinstance(self.weight, Int4Weight):
            return w4_lm_head_logits(x, self.weight)
        if isinstance(self.weight, QTensor):
            acc = int8_gemm(x.codes, self.weight.codes).to(torch.float32)
            return to_output(torch.tensor(self.alpha, dtype=torch.float32) * acc, self.out)
        if isinstance(self.out, FloatOut):  # float_linear's rounding, in place and by rows: no copies of the logits
            return round_rows_(nn.functional.linear(dequantize(x), dequantize(self.weight)), self.out.dtype)
        return float_linear(x, self.weight, self.out)


# bank -> (dtype, rotate, prep) -> (norm weight or None, lm_head weight): prepared once per run, shared between modes
_HEADS: "weakref.WeakKeyDictionary[WeightBank, dict]" = weakref.WeakKeyDictionary()


def _float_head(bank: WeightBank, dtype: torch.dtype, rotate: bool, prep: str) -> tuple[torch.Tensor | None, torch.Tensor]:
    cache = _HEADS.setdefault(bank, {})
    if (dtype, rotate, prep) not in cache and prep == "quamba" and rotate:  # Quamba's own fp16 head
        cache[(dtype, rotate, prep)] = (None, lm_head_weight(bank.ckpt))
    if (dtype, rotate, prep) not in cache:
        ckpt = bank.ckpt
        w = ckpt.tensor("lm_head.weight") if ckpt.has("lm_head.weight") else ckpt.embedding()  # tied: the embedding
        norm_w = round_to_dtype(ckpt.tensor(ckpt.final_norm_key).to(torch.float32), dtype)
        if rotate:  # rounded to dtype block by block there: no unrotated copy of the head
            norm_w, w = None, rotated_head(w, norm_w, dtype)
        else:
            w = round_to_dtype(w.to(torch.float32), dtype)
        cache[(dtype, rotate, prep)] = (norm_w, w)
    release_freed()
    return cache[(dtype, rotate, prep)]


def _head_key(recipe: ModeRecipe) -> tuple[torch.dtype, bool, str]:
    return FLOAT_DTYPES["fp16" if recipe.weights in (Weights.INT8, Weights.INT4) else recipe.weights], recipe.rotate == Rotate.YES, recipe.prep


def keep_only(bank: WeightBank, recipes: list[ModeRecipe]) -> None:
    """Release the prepared blocks and heads that none of `recipes` (the modes still to run) uses.

    Peak memory then holds the weight variants of the modes to come, not of every mode run so far.
    """
    bank.keep_only({(r.weights, r.rotate == Rotate.YES, r.prep) for r in recipes})
    heads, needed = _HEADS.get(bank, {}), {_head_key(r) for r in recipes}
    for key in [k for k in heads if k not in needed]:
        del heads[key]


def build_head(recipe: ModeRecipe, bank: WeightBank, head_scale: float | None = None) -> Head:
    dims, rotate = bank.dims, recipe.rotate == Rotate.YES
    act = FloatOut(act_dtype(recipe))
    if recipe.lm_head == LmHead.QUANTIZED:  # the recipe's quantized Linear of its own fp16 head (kernels.embedding_head)
        fp16_head = build_head(replace(recipe, lm_head=LmHead.FP16), bank)
        if isinstance(fp16_head.weight, (QTensor, Int4Weight)):  # a checkpoint exported with --quantize_lm_head
            return fp16_head
        if recipe.weights == Weights.INT4 and recipe.calibration_key == "quamba2-w4a16":
            # W4A16B16O16Linear.from_fp16(model.lm_head), norm_f unchanged (modelutils_mamba.py:650-652, c474646)
            return Head(fp16_head.norm, w4_lm_head(fp16_head.weight, a8=False), fp16_head.out)
        if head_scale is None:
            raise ValueError(f"mode {recipe.name!r}: lm_head=quantized needs the lm_head:input scale, which the "
                             f"calibration of the float model observes (a checkpoint's stored scales hold none)")
        norm = EmuRMSNorm(None, dims.norm_eps, QuantOut(head_scale, Rounding.HALF_EVEN))  # QRMSNorm at lm_head:input
        if recipe.weights == Weights.INT4:  # W4A8B16O16Linear.from_fp16 (modelutils_mamba.py:653-657; W4AX :740-743)
            return Head(norm, w4_lm_head(fp16_head.weight, a8=True), FloatOut(torch.float16))
        weight, alpha = w8a8_lm_head(fp16_head.weight, head_scale)
        return Head(norm, weight, FloatOut(torch.float16), alpha)
    if bank._uses_given(recipe.weights, rotate, recipe.prep):  # the Quamba checkpoint's own head
        weight, s_in, alpha = bank.given.lm_head()
        if s_in is not None:  # W8A8B16O16Linear, W4A8B16O16Linear
            # QRMSNorm: rint (half even) at the output scale (qNorm.py:38-39, spec notes §2.6 step 1)
            return Head(EmuRMSNorm(None, dims.norm_eps, QuantOut(s_in, Rounding.HALF_EVEN)), weight,
                        FloatOut(torch.float16), alpha)
        return Head(EmuRMSNorm(None, dims.norm_eps, act), weight, act)
    norm_w, w = _float_head(bank, *_head_key(recipe))
    return Head(EmuRMSNorm(norm_w, dims.norm_eps, act), w, act)
