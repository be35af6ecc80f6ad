"""Quamba's GPTQ of one linear, on CPU: the Hessian of its inputs, then the int4 group-128 weight (``Int4Weight``).

Source: enyac-group/Quamba at c474646, quamba/gptq_utils.py (a modified IST-DASLab/gptq).

* ``Hessian`` is ``GPTQ.add_batch`` (:105-119): per call with an input of ``b`` sequences, in float32,
  ``H *= n / (n + b)``, ``n += b``, ``x = sqrt(2 / n) * x``, ``H += x @ x.T``; Quamba calls it once per
  calibration sequence (modelutils_mamba.py:451-455, one sequence per forward), so H = (2 / N) sum x x^T.
* ``gptq_int4`` is ``GPTQ.fasterquant`` (:121-189) with Quamba's arguments (modelutils_mamba.py:462-464:
  percdamp 0.01, group 128, w_bits 4, dtype float32): dead columns (H_ii = 0) get H_ii = 1 and W[:, i] = 0;
  ``damp = 0.01 * mean(diag H)`` added to the diagonal; ``Hinv = cholesky(cholesky_inverse(cholesky(H)),
  upper=True)``; columns in their natural order (no act_order), the column block is the group (the lazy-batch
  block of 128 columns, :147-172); each group's scale ``max|W1| * (2/15)`` from the group's *updated* columns
  (:158, ``get_per_channel_scale`` :65-72); each column quantized with ``quant`` (:74-85: codes
  ``clamp(round(w / s) + 8, 0, 15)``, value ``((code - 8) * s).half()``), its error divided by ``Hinv[i, i]``
  fed to the group's later columns, then the group's errors times ``Hinv[group, later]`` to the later groups.
* The ``Int4Weight`` is what Marlin's ``from_fp16`` makes of GPTQ's result (qLinearLayer.py:42-76, 172-215;
  marlin_utils.py:221-252, 409-435): the fake-quantized fp16 weight and the fp16 group scale give the codes
  back as ``clamp(round(fp16(fp16(w / s16) + 8)), 0, 15)`` (a NaN from s16 = 0 becomes code 0, as torch's CPU
  cast of NaN to int32 and the clamp do; its value is 0 all the same).

Group size: 128 when in_features is a multiple of 128 (every Mamba-2 of Quamba's: d_model 768..4096). Quamba
cannot quantize other widths (fasterquant asserts ``128 <= in_dim`` and leaves a partial last group that
Marlin's ``w.reshape(-1, 128, n)`` refuses); the harness then uses one group per row (``group_size = in_features``,
the layout of Marlin's per-channel ``group_size=-1``), with the same quantizer (docs/fidelity.md).

The GPU computes H and the updates in float32 with cuBLAS's order; the CPU's BLAS sums in another order, so a
few codes can differ from Quamba's (docs/fidelity.md gives the measured share). ``dtype=torch.float64`` runs
the same algorithm in double for that measurement.
"""
from __future__ import annotations

import math

import torch

from ..kernels.int4 import ZERO_POINT, Int4Weight
from ..kernels.rounding import round_half_even

__all__ = ["Hessian", "gptq_int4", "gptq_group_size", "int4_quant", "marlin_codes", "PERCDAMP", "GROUP_SIZE"]

PERCDAMP = 0.01   # modelutils_mamba.py:463
GROUP_SIZE = 128  # modelutils_mamba.py:463
_MAXQ = 15


class Hessian:
    """``GPTQ.add_batch`` (gptq_utils.py:105-119): the running (2 / n) sum of x x^T in float32."""

    def __init__(self, in_features: int, dtype: torch.dtype = torch.float32) -> None:
        self.H = torch.zeros(in_features, in_features, dtype=dtype)
        self.nsamples = 0

    def add(self, inp: torch.Tensor) -> None:
        """inp: (b, L, in) or (L, in) — b sequences (2-D: one)."""
        if inp.dim() == 2:
            inp = inp.unsqueeze(0)
        tmp = inp.shape[0]
        x = inp.reshape(-1, inp.shape[-1]).t().to(self.H.dtype)
        self.H *= self.nsamples / (self.nsamples + tmp)
        self.nsamples += tmp
        x = math.sqrt(2 / self.nsamples) * x
        self.H += x.matmul(x.t())


def gptq_group_size(in_features: int) -> int:
    """128, or in_features when it is not a multiple of 128 (module docstring)."""
    return GROUP_SIZE if in_features % GROUP_SIZE == 0 else in_features


def int4_quant(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``quant`` (gptq_utils.py:74-85): w (out,) or (out, k), s broadcastable -> the fp16 value, as float32."""
    q = round_half_even(w / s)  # torch.round: half to even
    q = torch.where(torch.isnan(q), torch.zeros_like(q), q)  # ".int() will replace NaN with 0" (:80, CUDA)
    q = torch.clamp(q + ZERO_POINT, 0, _MAXQ)
    return ((q - ZERO_POINT) * s).to(torch.float32).to(torch.float16).to(w.dtype)


def _group_scale(W1: torch.Tensor) -> torch.Tensor:
    """``get_per_channel_scale`` (:65-72): max|w| over the group's columns, ``s *= 2 / 15`` in float32."""
    s = W1.abs().amax(dim=1, keepdim=True).to(torch.float32)
    return s * (2 / _MAXQ)


def _hinv(H: torch.Tensor, W: torch.Tensor, percdamp: float, dtype: torch.dtype) -> torch.Tensor:
    H = H.clone().to(dtype)
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    damp = percdamp * torch.mean(torch.diag(H))
    idx = torch.arange(H.shape[0])
    H[idx, idx] += damp
    L = torch.linalg.cholesky(H)
    return torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)


def gptq_int4(weight: torch.Tensor, H: torch.Tensor, group_size: int = GROUP_SIZE, percdamp: float = PERCDAMP,
              dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``fasterquant`` (module docstring). weight: (out, in) the layer's fp16 values; H: (in, in).
    Returns (Q (out, in) the fake-quantized weight, fp16 values as float32; group scales (out, in // group_size)
    float32 as ``layer.group_scale`` holds them, transposed)."""
    out_dim, in_dim = weight.shape
    assert in_dim % group_size == 0, f"in_features {in_dim} is not a multiple of the group size {group_size}"
    W = weight.clone().to(dtype)
    Hinv = _hinv(H, W, percdamp, dtype)
    Q = torch.zeros_like(W)
    scales = torch.zeros(out_dim, in_dim // group_size, dtype=torch.float32)
    for i1 in range(0, in_dim, group_size):
        i2 = i1 + group_size
        W1, Err1, Hinv1 = W[:, i1:i2].clone(), torch.zeros(out_dim, group_size, dtype=dtype), Hinv[i1:i2, i1:i2]
        s = _group_scale(W1)
        scales[:, i1 // group_size] = s[:, 0]
        s = s.to(dtype)
        for i in range(group_size):
            w, d = W1[:, i].clone(), Hinv1[i, i]
            q = int4_quant(w.unsqueeze(1), s).flatten()
            Q[:, i1 + i] = q
            err = (w - q) / d
            W1[:, i:] -= err.unsqueeze(1).matmul(Hinv1[i, i:].unsqueeze(0))
            Err1[:, i] = err
        W[:, i2:] -= Err1.matmul(Hinv[i1:i2, i2:])
    return Q.to(torch.float32), scales


def marlin_codes(q_fp16: torch.Tensor, group_scales_fp16: torch.Tensor) -> torch.Tensor:
    """The codes Marlin's from_fp16 recovers (marlin_utils.py:245-247, 432-435): q_fp16 (out, in) fp16 values,
    group_scales_fp16 (out, groups) fp16 values -> uint8 (out, in), ``clamp(round(fp16(fp16(w / s) + 8)), 0, 15)``."""
    out_dim, in_dim = q_fp16.shape
    g = in_dim // group_scales_fp16.shape[1]
    w = q_fp16.to(torch.float16).reshape(out_dim, -1, g)
    s = group_scales_fp16.to(torch.float16).unsqueeze(-1)
    v = round_half_even((w / s) + ZERO_POINT)  # fp16 quotient, fp16 + 8, then torch's round (half even)
    v = torch.where(torch.isnan(v), torch.zeros_like(v), v)  # CPU int cast of NaN then clamp -> 0
    return v.clamp(0, _MAXQ).reshape(out_dim, in_dim).to(torch.uint8)


def to_int4_weight(q: torch.Tensor, group_scales: torch.Tensor, channel: bool) -> Int4Weight:
    """GPTQ's result as Marlin (channel=False, W4A16) or Marlin-QQQ (channel=True, W4A8) holds it, before any
    output scale is fused: QQQ's s_channel = fp16(max|w|) / 127 (fp16 arithmetic, qLinearLayer.py:199-201),
    group scales fp16(fp16(s_group) / s_channel) (marlin_utils.py:248-252, NaN -> 0)."""
    s16 = group_scales.to(torch.float16)
    codes = marlin_codes(q, s16)
    if not channel:
        return Int4Weight(codes, s16, None, q.shape[1] // s16.shape[1])
    s_ch = (q.to(torch.float16).abs().amax(dim=1) / 127.0).to(torch.float32)
    fused = torch.nan_to_num((s16.to(torch.float32) / s_ch.unsqueeze(1)).to(torch.float16), nan=0.0)
    return Int4Weight(codes, fused, s_ch, q.shape[1] // s16.shape[1])
