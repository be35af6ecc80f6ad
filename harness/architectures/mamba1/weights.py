"""Weights of one block as a recipe needs them: folded and rotated, rounded to fp32/fp16, or int8.

Offline transforms (spec notes §2.1): fold the block's RMSNorm weight into in_proj's
columns (W_in[:, j] *= w_norm[j]) and rotate the residual stream with Had_D (see
kernels.hadamard): a residual vector x becomes Had_D x, so in_proj becomes W_in Had_D^T
(each row transformed), out_proj becomes Had_D W_out Had_E^T (the online Hadamard of
the SSM output supplies Had_E), and the embedding rows become Had_D e.

Two preparations (knob ``prep``):

* ``exact``: from the checkpoint's own precision, fold and rotation in float64,
  rounded once to the weight dtype (``float_layer``);
* ``quamba``: as Quamba computes them (``quamba_fp16_layer``, spec notes §2.1a): the
  checkpoint is first brought to fp16 (``build_mamba_and_tokenizer`` loads it with
  dtype=torch.float16, utils.py:21, 30); ``fuse_ln_linear`` multiplies the fp16
  in_proj by the fp16 norm weight in float64 and stores fp16 (modelutils_mamba.py:40-55,
  called at :76); ``fuse_hadamard`` (qLinearLayer.py:860-868) rotates in_proj's rows,
  and out_proj over its input dim then over its output dim, each with the
  fast_hadamard_transform kernel (fp32 butterflies over fp16 inputs,
  kernels.hadamard.hadamard_transform_fht), storing fp16 after each transform; the
  embedding is rotated the same way (configure_model, modelutils_mamba.py:66).

For int8 the fp16 result is quantized per tensor (kernels.quant.quantize_weight_fp16),
and A_log, D and dt_bias (fp32, dt_bias holding its fp16 value) with
quantize_param_fp32, as Quamba does after loading its fp16 model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...spec import QTensor
from ...kernels.hadamard import hadamard_transform_fht
from ...kernels.quant import quantize_param_fp32, quantize_weight_fp16, round_to_dtype
from ..transforms import rotated_projections

__all__ = ["LayerParams", "PREPS", "float_layer", "quamba_fp16_layer", "quamba_int8_layer", "int8_layer", "fht_fp16"]

PREPS: tuple[str, ...] = ("quamba", "exact")  # the values of the `prep` knob


@dataclass
class LayerParams:
    """Prepared parameters of one block; float tensors are fp32 holding values of their dtype.

    in_proj: (2 * d_inner, d_model); conv_weight: (d_inner, d_conv); conv_bias: (d_inner,);
    x_proj: (dt_rank + 2 * d_state, d_inner); dt_proj: (d_inner, dt_rank); dt_bias, D: (d_inner,);
    A_log: (d_inner, d_state); out_proj: (d_model, d_inner); norm_weight: (d_model,) or None (folded).
    """

    norm_weight: torch.Tensor | None
    in_proj: torch.Tensor | QTensor
    conv_weight: torch.Tensor | QTensor
    conv_bias: torch.Tensor | QTensor | None
    x_proj: torch.Tensor | QTensor
    dt_proj: torch.Tensor | QTensor
    dt_bias: torch.Tensor | QTensor
    A_log: torch.Tensor | QTensor
    D: torch.Tensor | QTensor
    out_proj: torch.Tensor | QTensor


def float_layer(raw: dict[str, torch.Tensor | None], rotate: bool, dtype: torch.dtype) -> LayerParams:
    """raw: fp32 tensors of the checkpoint (checkpoints.loading.Checkpoint.raw_layer)."""
    def rnd(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else round_to_dtype(t, dtype)

    in_proj, out_proj, norm_weight = rotated_projections(raw, rotate, rnd)
    return LayerParams(
        norm_weight=norm_weight, in_proj=in_proj, conv_weight=rnd(raw["conv_weight"]), conv_bias=rnd(raw["conv_bias"]),
        x_proj=rnd(raw["x_proj"]), dt_proj=rnd(raw["dt_proj"]), dt_bias=rnd(raw["dt_bias"]),
        A_log=raw["A_log"].to(torch.float32), D=raw["D"].to(torch.float32),  # mamba keeps A_log and D in fp32
        out_proj=out_proj)


def fht_fp16(w: torch.Tensor) -> torch.Tensor:
    """One fast_hadamard_transform call on an fp16 tensor, rows along the last dim: fp16 out (held in fp32)."""
    return round_to_dtype(hadamard_transform_fht(round_to_dtype(w, torch.float16)), torch.float16)


def quamba_fp16_layer(raw: dict[str, torch.Tensor | None], rotate: bool = True) -> LayerParams:
    """The fp16 weights of one block exactly as Quamba prepares them (prep=quamba; module docstring).

    raw: fp32 tensors of the checkpoint (checkpoints.loading.Checkpoint.raw_layer). Returns fp16 values held
    in fp32 (A_log and D stay fp32: mamba_ssm creates them as fp32 parameters, spec notes §1.3). With
    rotate=False nothing is folded or rotated: the checkpoint rounded to fp16, the same as prep=exact.
    """
    if not rotate:
        return float_layer(raw, False, torch.float16)
    f16 = lambda t: round_to_dtype(t, torch.float16)  # noqa: E731
    in16, norm16 = f16(raw["in_proj"]), f16(raw["norm_weight"])
    folded = f16(in16.to(torch.float64) * norm16.to(torch.float64))      # fuse_ln_linear: fp64 product, fp16 store
    in_proj = fht_fp16(folded)                                             # W Had_D^T, fp16 store
    right = fht_fp16(f16(raw["out_proj"]))                                 # input transform: W Had_E^T, fp16 store
    out_proj = fht_fp16(right.t()).t()                                     # output transform on W.t(), fp16 store
    return LayerParams(
        norm_weight=None, in_proj=in_proj, conv_weight=f16(raw["conv_weight"]),
        conv_bias=None if raw["conv_bias"] is None else f16(raw["conv_bias"]),
        x_proj=f16(raw["x_proj"]), dt_proj=f16(raw["dt_proj"]), dt_bias=f16(raw["dt_bias"]),
        A_log=raw["A_log"].to(torch.float32), D=raw["D"].to(torch.float32), out_proj=out_proj)


def quamba_int8_layer(raw: dict[str, torch.Tensor | None], rotate: bool = True) -> LayerParams:
    """Quamba's W8A8 weights of one block: int8_layer(quamba_fp16_layer(raw, rotate))."""
    return int8_layer(quamba_fp16_layer(raw, rotate))


def int8_layer(fp16: LayerParams) -> LayerParams:
    """Per-tensor int8 of an fp16 layer; the norm weight (unrotated models) stays fp16."""
    return LayerParams(
        norm_weight=fp16.norm_weight, in_proj=quantize_weight_fp16(fp16.in_proj),
        conv_weight=quantize_weight_fp16(fp16.conv_weight),
        conv_bias=None if fp16.conv_bias is None else quantize_weight_fp16(fp16.conv_bias),
        x_proj=quantize_weight_fp16(fp16.x_proj), dt_proj=quantize_weight_fp16(fp16.dt_proj),
        dt_bias=quantize_param_fp32(fp16.dt_bias), A_log=quantize_param_fp32(fp16.A_log),
        D=quantize_param_fp32(fp16.D), out_proj=quantize_weight_fp16(fp16.out_proj))
