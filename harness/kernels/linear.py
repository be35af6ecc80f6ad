"""W8A8 linear layers: int8 x int8 GEMM with exact integer accumulation and the fp32 epilogue.

The CUTLASS kernels of Quamba1 accumulate in int32 and rescale with two fp32
multiplies whose order depends on the call site (spec notes §2.6 steps 2, 4, 5, 9):

    RATIO_THEN_WEIGHT (in_proj, dt_proj; `to_seqlen_last`):
        t = f32(f32(s_x / s_out) * f32(acc));  v = f32(s_w * t)
    WEIGHT_THEN_RATIO (x_proj, out_proj; `forward`):
        t = f32(s_w * f32(acc));               v = f32(f32(s_x / s_out) * t)

For an int8 output, q = sat8(RNE(v)) (PTX cvt.rni.sat). For a float output
(out_proj; in_proj in mode 3) s_out is 1, so the ratio is s_x itself, and v is
rounded to the output dtype (fp16 in W8A8B16O16).

The accumulator is the kernel's int32 result (whose saturation is never reached:
|acc| <= K * 128 * 128 < 2**31 for K < 131072). It comes from fp32 matmuls over
blocks of K <= 1024, where every partial sum is an integer of magnitude
<= 1024 * 128 * 128 = 2**24 and therefore exact in fp32 whatever the summation order
or FMA use, with the block sums added in float64 (exact below 2**53): the same
integers on every CPU.

Not ``torch._int_mm``: on CPUs without VNNI (AVX2-only, and AVX-512 ones such as
Skylake-SP) oneDNN's s8 x s8 kernel saturates its int16 intermediate sums (vpmaddubsw)
and returns wrong accumulators: measured on this AVX-512 machine with
DNNL_MAX_CPU_ISA=AVX2, errors up to 158,792 on a (512 x 768) @ (768 x 3072) product of
random codes (docs/determinism.md). The exact path costs 15.3 ms against _int_mm's
3.2 ms for the four GEMMs of one mamba-130m block at 512 tokens.
"""
from __future__ import annotations

import enum

import numpy as np
import torch

from ..spec import FloatOut, OutSpec, QTensor, QuantOut, Rounding
from .quant import dequantize, f32, quantize_prescaled, to_output
from .rounding import round_half_even

__all__ = ["q2_in_proj", "q2_in_proj_ref", "Epilogue", "int8_gemm", "int8_gemm_float", "w8a8_linear", "w8a8_linear_ref", "float_linear"]


class Epilogue(str, enum.Enum):
    RATIO_THEN_WEIGHT = "ratio_then_weight"
    WEIGHT_THEN_RATIO = "weight_then_ratio"


_EXACT_K = 1024  # 1024 * 128 * 128 = 2**24: the largest K whose fp32 partial sums stay exact


def int8_gemm(x_codes: torch.Tensor, w_codes: torch.Tensor) -> torch.Tensor:
    """acc = x @ w.T, exact: the kernel's int32 accumulator.

    x_codes: (..., k) int8; w_codes: (n, k) int8 -> (..., n) int32.
    """
    x2 = x_codes.reshape(-1, x_codes.shape[-1])
    return int8_gemm_float(x2, w_codes).reshape(*x_codes.shape[:-1], w_codes.shape[0])


def int8_gemm_float(x_codes: torch.Tensor, w_codes: torch.Tensor, w_float: torch.Tensor | None = None) -> torch.Tensor:
    """``int8_gemm`` by exact float matmuls (module docstring): x (..., k) int8, w (n, k) int8 -> (..., n) int32.

    w_float: w_codes already as fp32 (a decode step's GEMV reuses it: converting the weight is most of its cost).
    """
    if torch.get_float32_matmul_precision() != "highest":  # reduced-precision fp32 GEMMs would not be exact
        return (x_codes.to(torch.float64) @ w_codes.to(torch.float64).t()).to(torch.int32)
    xf, wf = x_codes.to(torch.float32), w_codes.to(torch.float32) if w_float is None else w_float
    acc = None
    for start in range(0, xf.shape[-1], _EXACT_K):
        block = (xf[..., start:start + _EXACT_K] @ wf[:, start:start + _EXACT_K].t()).to(torch.float64)
        acc = block if acc is None else acc + block
    return acc.to(torch.int32)


def _epilogue(acc: torch.Tensor, s_x: float, s_w: float, s_out: float, order: Epilogue) -> torch.Tensor:
    ratio = torch.tensor(f32(s_x / s_out), dtype=torch.float32)
    weight = torch.tensor(s_w, dtype=torch.float32)
    acc32 = acc.to(torch.float32)
    if order is Epilogue.RATIO_THEN_WEIGHT:
        return weight * (ratio * acc32)
    if order is Epilogue.WEIGHT_THEN_RATIO:
        return ratio * (weight * acc32)
    raise ValueError(f"unknown epilogue order {order!r}; valid: {[e.value for e in Epilogue]}")


def w8a8_linear(x: QTensor, w: QTensor, order: Epilogue, out: OutSpec) -> QTensor | torch.Tensor:
    """Quamba W8A8 linear layer.

    x: (..., k) int8 codes at x.scale; w: (n, k) int8 codes at w.scale.
    out: QuantOut(s_out, HALF_EVEN) for W8A8B8O8, or FloatOut(dtype) for W8A8B16O16.
    Returns (..., n): int8 at s_out, or fp32 holding values of out.dtype.
    """
    acc = int8_gemm(x.codes, w.codes)
    if isinstance(out, QuantOut):
        assert out.rounding is Rounding.HALF_EVEN, "CUTLASS int8 epilogues round half to even"
        return quantize_prescaled(_epilogue(acc, x.scale, w.scale, out.scale, order), out.scale, out.rounding)
    return to_output(_epilogue(acc, x.scale, w.scale, 1.0, order), out)


def w8a8_linear_ref(x: QTensor, w: QTensor, order: Epilogue, out: OutSpec) -> QTensor | torch.Tensor:
    """Oracle for ``w8a8_linear``: int64 integer accumulation, scalar epilogue written out."""
    acc = (x.codes.to(torch.int64).unsqueeze(-2) * w.codes.to(torch.int64)).sum(-1)  # (..., n) int64
    s_out = out.scale if isinstance(out, QuantOut) else 1.0
    ratio = torch.tensor(f32(x.scale / s_out), dtype=torch.float32)
    s_w = torch.tensor(w.scale, dtype=torch.float32)
    acc32 = acc.to(torch.float32)
    v = s_w * (ratio * acc32) if order is Epilogue.RATIO_THEN_WEIGHT else ratio * (s_w * acc32)
    if isinstance(out, FloatOut):
        return v.to(out.dtype).to(torch.float32)
    q = round_half_even(v).clamp(-128, 127).to(torch.int8)
    return QTensor(q, out.scale)


def float_linear(x: QTensor | torch.Tensor, w: QTensor | torch.Tensor, out: OutSpec) -> QTensor | torch.Tensor:
    """Linear layer on real values: fp32 matmul of the (dequantized) operands, then the output rule.

    Used whenever one operand is not int8 (float modes, weight-only or activation-only recipes).
    x: (..., k); w: (n, k) -> (..., n).
    """
    return to_output(torch.nn.functional.linear(dequantize(x), dequantize(w)), out)


# Quamba2's int8 in_proj of the Mamba-2 block, split-wise output scales.
# in_proj (``W8A8B8O8LinearParallel``, quamba/qLinearLayer.py:653-742): the weight is split by rows
# into z | x | B | C | dt, each split quantized per tensor at its own s_w; ``b`` holds, per output column,
# f32(s_w(split) / s_out(split)) (:698, :709-711), ``a`` the input scale (:706-708). The output is int8
# (``y`` has x's dtype, :732). The CUTLASS epilogue (csrc/linear/quant_linear_fwd_kernel.cuh:84-106)
# is ``Compute0 = ScaleB * Accum`` in fp32, then ``Compute1 = ScaleA * Compute0`` converted to int8
# with round_to_nearest (PTX cvt.rni.sat: half to even, saturating):
# 
#     q[.., j] = sat8(RNE(f32(a * f32(b[j] * f32(acc[.., j])))))
# 
# (batch * seqlen = 1 takes ``w8a8o8_gemv``, :733-736: the decode step, kernels.ssd_step.q2_gemv.)
def q2_in_proj(x: QTensor, w_codes: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """x: (..., d_model) int8 at x.scale (``a``); w_codes: (n, d_model) int8; b: (n,) fp32 per-column factors.
    Returns (..., n) int8 codes (each split at its own output scale)."""
    acc = int8_gemm(x.codes, w_codes).to(torch.float32)
    a = torch.tensor(x.scale, dtype=torch.float32)
    v = a * (b.to(torch.float32) * acc)
    return round_half_even(v).clamp(-128, 127).to(torch.int8)


def q2_in_proj_ref(x: QTensor, w_codes: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Oracle of q2_in_proj: int64 dot products, then the epilogue element by element in numpy float32."""
    xs = x.codes.reshape(-1, x.codes.shape[-1]).to(torch.int64).numpy()
    w = w_codes.to(torch.int64).numpy()
    bs = b.to(torch.float32).numpy()
    a = np.float32(x.scale)
    out = np.zeros((xs.shape[0], w.shape[0]), dtype=np.int8)
    for r in range(xs.shape[0]):
        for j in range(w.shape[0]):
            acc = np.float32(int(np.dot(xs[r], w[j])))
            v = float(a * np.float32(bs[j] * acc))
            q = float(np.rint(v))  # half to even
            out[r, j] = int(min(127.0, max(-128.0, q)))
    return torch.from_numpy(out).reshape(*x.codes.shape[:-1], w.shape[0])
