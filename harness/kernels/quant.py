"""Rounding, saturation, quantize/dequantize and scale rules of the Quamba1 W8A8 recipe.

This module is the only place that rounds a float to an integer. Every rule
names its tie behaviour (``Rounding``) and its scale step:

* activations are quantized by **dividing** by the scale in fp32, rounding with
  the op's tie rule, then saturating to [-128, 127] (round, then clamp);
* weights follow ``quantize_tensor_per_tensor_absmax`` (spec notes §2.5): the scale
  max|W| / 127 and the quotient W / scale are computed **in fp16**, then rounded
  half-to-even and clamped;
* SSM parameters (A_log, D, dt_bias) follow ``quantize_weight_per_tensor_absmax``:
  the same rule in fp32, without a clamp (|W / s| <= 127 by construction);
* min-max activation scales are max|a| / 127 computed in fp16 (the observed
  tensor is fp16), percentile scales w / 127 in fp32; both clamp at 1e-6.

The divisor is 127 (qmax), not torchao's 127.5 ((qmax - qmin) / 2).
"""
from __future__ import annotations

import torch

from ..spec import INT8_BOUNDS, FloatOut, FormatOut, OutSpec, QTensor, QuantOut, Rounding, SplitOut
from .formats import fake_quantize
from .rounding import round_half_even, round_with

__all__ = [
    "saturate_int8",
    "quantize",
    "quantize_prescaled",
    "dequantize",
    "to_output",
    "round_to_dtype",
    "fma_f32",
    "f32",
    "quantize_weight_fp16",
    "quantize_param_fp32",
    "minmax_scale_fp16",
    "scale_from_amax_fp32",
    "quantize_rows_signed_max_fp16",
]

_QMIN, _QMAX = INT8_BOUNDS
_SCALE_FLOOR = 1e-6  # observer.py: scales.clamp(min=1e-6)
_AMAX_FLOOR = 1e-5   # observer.py / quant_utils.py: amax.clamp(min=1e-5)


def saturate_int8(r: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Clamp already-rounded values to [-128, 127]; returns (int8 codes, how many were clipped).

    A NaN has no code (the cast would make it 0 and hide it from every later check): it raises
    FloatingPointError, which fails the mode that computed it. +-Inf saturates like any large value.
    """
    lo, hi = torch.aminmax(r)
    if lo >= _QMIN and hi <= _QMAX:  # the usual case: one pass to check, nothing to clip
        return r.to(torch.int8), 0
    if bool(torch.isnan(lo) | torch.isnan(hi)):  # aminmax propagates NaN: free on the usual path
        raise FloatingPointError(f"non-finite values: {int(torch.isnan(r).sum())} NaN of {r.numel()} values "
                                 f"reach an int8 quantization (NaN has no int8 code)")
    n_clipped = int(((r < _QMIN) | (r > _QMAX)).sum())
    return r.clamp(_QMIN, _QMAX).to(torch.int8), n_clipped


def quantize(x: torch.Tensor, scale: float, rounding: Rounding) -> QTensor:
    """sat8(round(x / scale)), the division done in fp32.

    x: (any) fp32; scale: fp32-representable float > 0.
    """
    return quantize_prescaled(x.to(torch.float32) / torch.tensor(scale, dtype=torch.float32), scale, rounding)


def quantize_prescaled(v: torch.Tensor, scale: float, rounding: Rounding) -> QTensor:
    """sat8(round(v)) for v already in code units (a kernel multiplied by 1/scale itself)."""
    codes, n_clipped = saturate_int8(round_with(v, rounding))
    return QTensor(codes, scale, n_clipped)


def dequantize(x: QTensor | torch.Tensor) -> torch.Tensor:
    """Real values in fp32: codes * scale for a QTensor, the tensor itself otherwise."""
    return x.dequantize() if isinstance(x, QTensor) else x


def round_to_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round fp32/fp64 values to ``dtype`` (RNE) and hand them back as fp32."""
    return x.to(dtype).to(torch.float32)


def to_output(v: torch.Tensor, out: OutSpec) -> QTensor | torch.Tensor:
    """Store an fp32 result as the op's output: quantized, rounded to its float dtype, or fake-quantized in a
    number format (FormatOut: kernels.formats.fake_quantize)."""
    if isinstance(out, QuantOut):
        return quantize(v, out.scale, out.rounding)
    if isinstance(out, FloatOut):
        return round_to_dtype(v, out.dtype)
    if isinstance(out, FormatOut):
        return fake_quantize(v.to(torch.float32), out.fmt)
    if isinstance(out, SplitOut):
        parts = v.split(list(out.widths), dim=-1)
        return torch.cat([to_output(part, o) for part, o in zip(parts, out.outs)], dim=-1)
    raise TypeError(f"unknown output spec {out!r}")


def f32(x: float) -> float:
    """Round a Python float (double) to the nearest fp32 value, as a kernel's `float` argument does."""
    return float(torch.tensor(x, dtype=torch.float32))


def fma_f32(a: torch.Tensor | float, b: torch.Tensor, c: torch.Tensor | float) -> torch.Tensor:
    """fp32 fused multiply-add a * b + c with one rounding.

    nvcc contracts `a * b + c` into an FMA by default. Emulated in float64: the
    product of two fp32 numbers is exact there; the sum rounds once to float64 and
    once more to fp32, which equals the FMA except for rare double-rounding cases.
    """
    a64 = a.to(torch.float64) if isinstance(a, torch.Tensor) else a
    c64 = c.to(torch.float64) if isinstance(c, torch.Tensor) else c
    return (a64 * b.to(torch.float64) + c64).to(torch.float32)


def minmax_scale_fp16(amax_fp16: torch.Tensor) -> float:
    """Scale of a min-max observer: fp16 max|a| (floored at 1e-5) / 127 in fp16, then fp32, floored at 1e-6."""
    amax = amax_fp16.to(torch.float16).clamp(min=_AMAX_FLOOR)
    return float((amax / _QMAX).to(torch.float32).clamp(min=_SCALE_FLOOR))


def scale_from_amax_fp32(amax: torch.Tensor) -> float:
    """Scale of a percentile observer: fp32 w / 127, floored at 1e-6."""
    return float((amax.to(torch.float32) / _QMAX).clamp(min=_SCALE_FLOOR))


def quantize_weight_fp16(w: torch.Tensor) -> QTensor:
    """Per-tensor absmax int8 of a linear/conv weight or conv bias, computed in fp16 (spec notes §2.5).

    w: (any) fp16 values. s = f16(max(|w|, 1e-5) / 127); q = clamp(RNE(f16(w / s)), -128, 127).
    """
    w16 = w.to(torch.float16)
    s = w16.abs().amax().clamp(min=_AMAX_FLOOR) / _QMAX
    r = round_half_even(w16 / s).to(torch.float32)
    codes, n_clipped = saturate_int8(r)
    return QTensor(codes, float(s.to(torch.float32)), n_clipped)


def quantize_param_fp32(w: torch.Tensor) -> QTensor:
    """Per-tensor absmax int8 of an SSM parameter (A_log, D, dt_bias) in fp32, no clamp (spec notes §2.5).

    w: (any) fp32. s = max(|w|, 1e-5) / 127; q = RNE(w / s), which lies in [-127, 127].
    """
    w32 = w.to(torch.float32)
    s = w32.abs().max().clamp(min=_AMAX_FLOOR) / _QMAX
    r = round_half_even(w32 / s)
    assert r.abs().max() <= _QMAX, "absmax quantization produced a code beyond 127"
    return QTensor(r.to(torch.int8), float(s), 0)


def quantize_rows_signed_max_fp16(e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W8O16Embedding.from_fp16 (Quamba qEmbedding.py:86-89): per row s = f16(max(e) / 127), the row's
    signed max (not max|e|: rows whose minimum is below -max saturate at -128), q = sat8(RNE(f16(e / s))).

    e: (rows, d) fp16 values -> (codes (rows, d) int8, scales (rows,) fp16). A row with max 0 has scale 0:
    its negative entries saturate at -128 and its zeros (0/0, NaN) become code 0 here (the GPU cast of NaN
    is unspecified).
    """
    e16 = e.to(torch.float16)
    s = e16.amax(dim=-1, keepdim=True) / _QMAX
    r = torch.nan_to_num(round_half_even(e16 / s).to(torch.float32), nan=0.0)
    codes, _ = saturate_int8(r)
    return codes, s.flatten()
