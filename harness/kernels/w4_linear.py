"""Quamba2's int4-weight linears (W4A16: Marlin; W4A8: Marlin-QQQ), each with a written-out ``*_ref`` twin.

Sources: enyac-group/Quamba at c474646.

* W4A16 (``W4A16B16O16Linear.forward``, quamba/qLinearLayer.py:88-107, kernel csrc/linear/marlin_gemm_kernel.cuh):
  fp16 activations times the weight dequantized in fp16, ``fp16(code - 8) * s16`` rounded to fp16 (the kernel
  turns the code into fp16 ``code - 8`` exactly, then multiplies by the fp16 group scale in fp16), products
  summed in fp32 by the tensor cores, the fp32 result rounded to fp16. The tensor cores' and the slices'
  summation order is not reproducible on a CPU: here the products (exact in float64) are summed in float64,
  then rounded to fp32 and to fp16 (docs/fidelity.md).
* W4A8 (``W4A8B8O8LinearParallel`` / ``W4A8B16O16Linear``, qLinearLayer.py:420-536, 139-276; kernels
  csrc/linear/marlin_qqq_gemm_kernel.cuh and _o8.cuh): the code becomes an int8 inside the kernel,
  ``dequant_per_group`` (marlin_qqq_gemm_kernel.cuh:136-178): ``hfma2(code - 8, s_group16, 1152)`` keeps the
  low byte of an fp16 in [1024, 2048), i.e. ``w8 = rne((code - 8) * s_group16)`` wrapped into int8 (the fma
  rounds once; 1152 is even so ties go to even); int8 x int8 products with int32 accumulation over all of k
  (exact); the epilogue ``fp32(acc) * s_ch * s_tok`` left to right in fp32 (:744-749), then ``cvt.rn.f16``
  (O16) or ``cvt.rni.s8`` (O8: half to even, saturating; _o8.cuh:107-116, 756-761).
"""
from __future__ import annotations

import numpy as np
import torch

from ..spec import QTensor
from .int4 import ZERO_POINT, Int4Weight
from .linear import int8_gemm
from .rounding import round_half_even
from .quant import round_to_dtype

__all__ = ["w4a16_weight", "w4a16_linear", "w4a16_linear_ref", "qqq_int8_weight", "qqq_int8_weight_ref",
           "w4a8_values", "w4a8_linear", "w4a8_linear_ref"]


def w4a16_weight(w: Int4Weight) -> torch.Tensor:
    """(out, in) fp16 values (as fp32): fp16((code - 8) * s16) per group."""
    s = w.group_scales.to(torch.float32).repeat_interleave(w.group_size, dim=1)
    return round_to_dtype((w.codes.to(torch.float32) - ZERO_POINT) * s, torch.float16)


def w4a16_linear(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """x: (..., in) fp16 values -> (..., out) fp16 values (module docstring)."""
    wq = w4a16_weight(w).to(torch.float64)
    acc = x.to(torch.float64).reshape(-1, x.shape[-1]) @ wq.t()
    return round_to_dtype(acc.to(torch.float32), torch.float16).reshape(*x.shape[:-1], w.shape[0])


def w4a16_linear_ref(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """Oracle of w4a16_linear, element by element with numpy fp16 and exact (fsum) sums."""
    import math
    xs = x.reshape(-1, x.shape[-1]).to(torch.float16).numpy()
    codes, gs = w.codes.numpy(), w.group_scales.to(torch.float16).numpy()
    out = np.zeros((xs.shape[0], codes.shape[0]), dtype=np.float16)
    for j in range(codes.shape[0]):
        wj = [np.float16(np.float16(int(codes[j, k]) - ZERO_POINT) * gs[j, k // w.group_size])
              for k in range(codes.shape[1])]
        for r in range(xs.shape[0]):
            acc = math.fsum(float(xs[r, k]) * float(wj[k]) for k in range(codes.shape[1]))
            out[r, j] = np.float16(np.float32(acc))
    return torch.from_numpy(out.astype(np.float32)).reshape(*x.shape[:-1], codes.shape[0])


def qqq_int8_weight(w: Int4Weight) -> torch.Tensor:
    """(out, in) int8: the kernel's ``dequant_per_group`` of every code (module docstring)."""
    s = w.group_scales.to(torch.float64).repeat_interleave(w.group_size, dim=1)
    exact = (w.codes.to(torch.float64) - ZERO_POINT) * s + 1152.0        # exact in float64
    bits = exact.to(torch.float16).view(torch.int16).to(torch.int32)     # the fma's one rounding
    return ((bits & 0xFF) ^ 0x80).to(torch.uint8).view(torch.int8)


def qqq_int8_weight_ref(w: Int4Weight) -> torch.Tensor:
    """Oracle: the fp16 bit pattern of hfma2(code - 8, s, 1152), its low byte XOR 0x80, element by element."""
    codes, gs = w.codes.numpy(), w.group_scales.to(torch.float16).numpy()
    out = np.zeros(codes.shape, dtype=np.int8)
    for j in range(codes.shape[0]):
        for k in range(codes.shape[1]):
            exact = float(int(codes[j, k]) - ZERO_POINT) * float(gs[j, k // w.group_size]) + 1152.0
            bits = int(np.array(np.float16(exact)).view(np.uint16))  # one rounding: the fma's (to even)
            out[j, k] = np.array((bits & 0xFF) ^ 0x80, dtype=np.uint8).view(np.int8)
    return torch.from_numpy(out)


def w4a8_values(x: QTensor, w: Int4Weight, w8: torch.Tensor | None = None) -> torch.Tensor:
    """The Marlin-QQQ epilogue before its output rounding: ``fp32(acc) * s_ch * s_tok`` (..., out) fp32.
    w8: ``qqq_int8_weight(w)`` when the caller keeps it (computed here otherwise)."""
    assert w.channel_scales is not None, "a W4A8 weight needs its per-channel scales (Marlin-QQQ)"
    acc = int8_gemm(x.codes, qqq_int8_weight(w) if w8 is None else w8).to(torch.float32)
    return (acc * w.channel_scales.to(torch.float32)) * torch.tensor(x.scale, dtype=torch.float32)


def w4a8_linear(x: QTensor, w: Int4Weight, out_int8: bool) -> torch.Tensor:
    """x: (..., in) int8 at x.scale (``s_tok``, per tensor); w with channel_scales (``s_ch``, any output scale
    fused in). Returns (..., out): int8 codes when out_int8 (W4A8B8O8), else fp16 values (W4A8B16O16)."""
    v = w4a8_values(x, w)
    if out_int8:
        return round_half_even(torch.nan_to_num(v, nan=0.0)).clamp(-128, 127).to(torch.int8)
    return round_to_dtype(v, torch.float16)


def w4a8_linear_ref(x: QTensor, w: Int4Weight, out_int8: bool) -> torch.Tensor:
    """Oracle of w4a8_linear: int64 dot products with the int8 weights of qqq_int8_weight_ref, the epilogue in
    numpy float32 element by element."""
    xs = x.codes.reshape(-1, x.codes.shape[-1]).to(torch.int64).numpy()
    w8 = qqq_int8_weight_ref(w).to(torch.int64).numpy()
    s_ch, s_tok = w.channel_scales.to(torch.float32).numpy(), np.float32(x.scale)
    out = np.zeros((xs.shape[0], w8.shape[0]), dtype=np.int8 if out_int8 else np.float32)
    for r in range(xs.shape[0]):
        for j in range(w8.shape[0]):
            acc = int(sum(int(a) * int(b) for a, b in zip(xs[r], w8[j])))
            v = np.float32(np.float32(np.float32(acc) * s_ch[j]) * s_tok)
            out[r, j] = int(min(127.0, max(-128.0, float(np.rint(v))))) if out_int8 else float(np.float16(v))
    return torch.from_numpy(out).reshape(*x.codes.shape[:-1], w8.shape[0])
