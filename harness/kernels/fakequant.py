"""Fake quantization (quantize, then dequantize, in one fp32 tensor) as the field's other recipes compute it
(docs/field-recipes.md; /work/shared/reference/field-recipes-notes.md, "the notes").

Notation of the notes §0: ``fq_sym(x; s) = s * clamp(RNE(x / s), -128, 127)`` and
``fq_asym(x; s, z) = s * (clamp(RNE(x / s) + z, 0, 2^n - 1) - z)``.

* ``fq_sym``: Quamba1's simulated path (enyac-group/Quamba@624361b quamba/fake_quant/quantUtils.py:17-47):
  static activations at a calibrated scale, weights at ``max|W|.clamp(1e-5) / 127``;
* ``fq_sym_dynamic``: PTQ-SSM's W8A8Linear (mikequ1/PTQ-SSM@67d764b smoothquant/smoothquant/fake_quant.py:7-46):
  per call over the whole tensor, ``max|x| / 127`` (clamped at 1e-5), RNE, no clamp;
* ``fq_asym_rows``: MambaQuant's UniformAffineQuantizer (MambaQuant/MambaQuant@a4803c4 quantize/quantizer.py:
  131-163, 273-298): one (scale, zero point) per leading index (a sequence, or a weight's output row) from that
  row's min and max, the scale clamped to [1e-5, 1e4];
* ``percentile_clip_rows``: the clip range of MambaQuant's weight observer (percentile 0.999999 of each row's
  values; quantize/observers/hist_observers.py:11-68), here as ``torch.quantile`` of the row (the upstream
  interpolates a 2048-bin histogram: near, not bit-equal).

Every op has a ``*_ref`` twin, an element-by-element loop the tests compare against.
"""
from __future__ import annotations

import torch

from .rounding import round_half_even

__all__ = ["fq_sym", "fq_sym_ref", "absmax_scale", "fq_sym_dynamic", "fq_sym_dynamic_ref", "asym_params",
           "fq_asym", "fq_asym_ref", "fq_asym_rows", "fq_asym_rows_ref", "percentile_clip_rows", "fq_sym_rows",
           "fq_sym_rows_ref", "sym_mse_scales", "sym_mse_scales_ref", "fq_sym_codes"]

_AMAX_FLOOR = 1e-5  # quantUtils.py:26-47 and fake_quant.py:38-46: amax.clamp(min=1e-5)
_SCALE_LO, _SCALE_HI = 1e-5, 1e4  # quantizer.py:293-298


def fq_sym(x: torch.Tensor, scale: float | torch.Tensor, bits: int = 8, clamp: bool = True) -> torch.Tensor:
    """s * clamp(RNE(x / s), -2^(n-1), 2^(n-1) - 1) (clamp=False: PTQ-SSM's, unclamped); fp32."""
    q = round_half_even(x.to(torch.float32) / scale)
    if clamp:
        q = q.clamp(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    return q * scale


def fq_sym_ref(x: torch.Tensor, scale: float, bits: int = 8, clamp: bool = True) -> torch.Tensor:
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    out = torch.empty_like(x, dtype=torch.float32)
    flat, res = x.reshape(-1).tolist(), out.view(-1)
    for i, v in enumerate(flat):
        q = float(round_half_even(torch.tensor(float(torch.tensor(v, dtype=torch.float32) / scale))))
        res[i] = (min(max(q, lo), hi) if clamp else q) * scale
    return out


def absmax_scale(x: torch.Tensor, bits: int = 8) -> float:
    """max|x|.clamp(1e-5) / (2^(n-1) - 1) over the whole tensor, an fp32 value."""
    return float(x.abs().max().clamp(min=_AMAX_FLOOR).to(torch.float32) / (2 ** (bits - 1) - 1))


def fq_sym_dynamic(x: torch.Tensor, bits: int = 8, clamp: bool = True) -> torch.Tensor:
    """fq_sym at this tensor's own absmax scale (a weight, or PTQ-SSM's dynamic activation)."""
    return fq_sym(x, absmax_scale(x, bits), bits, clamp)


def fq_sym_dynamic_ref(x: torch.Tensor, bits: int = 8, clamp: bool = True) -> torch.Tensor:
    amax = max(max(abs(v) for v in x.reshape(-1).tolist()), _AMAX_FLOOR)
    return fq_sym_ref(x, float(torch.tensor(amax, dtype=torch.float32) / (2 ** (bits - 1) - 1)), bits, clamp)


def fq_sym_rows(w: torch.Tensor, bits: int) -> torch.Tensor:
    """Symmetric per output row (dim 0): s_r = max_c |w[r, c]|.clamp(1e-5) / (2^(n-1) - 1)."""
    s = w.abs().amax(dim=tuple(range(1, w.dim())), keepdim=True).clamp(min=_AMAX_FLOOR) / (2 ** (bits - 1) - 1)
    return fq_sym(w, s, bits)


def fq_sym_rows_ref(w: torch.Tensor, bits: int) -> torch.Tensor:
    return torch.stack([fq_sym_dynamic_ref(row, bits) for row in w])


def asym_params(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero point) from a range: scale = (hi - lo) / (2^n - 1) clamped to [1e-5, 1e4],
    zp = RNE(-lo / scale) (quantizer.py:293-298)."""
    scale = ((hi - lo) / (2 ** bits - 1)).clamp(_SCALE_LO, _SCALE_HI)
    return scale, round_half_even(-lo / scale).clamp(-1e4, 1e4)


def fq_asym(x: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, bits: int) -> torch.Tensor:
    """s * (clamp(RNE(x / s) + z, 0, 2^n - 1) - z) (quantizer.py:131-163)."""
    q = (round_half_even(x / scale) + zp).clamp(0, 2 ** bits - 1)
    return (q - zp) * scale


def fq_asym_ref(x: torch.Tensor, scale: float, zp: float, bits: int) -> torch.Tensor:
    out = torch.empty_like(x, dtype=torch.float32)
    flat, res = x.reshape(-1).tolist(), out.view(-1)
    for i, v in enumerate(flat):
        q = float(round_half_even(torch.tensor(float(torch.tensor(v, dtype=torch.float32) / scale)))) + zp
        res[i] = (min(max(q, 0), 2 ** bits - 1) - zp) * scale
    return out


def fq_asym_rows(x: torch.Tensor, bits: int, lo: torch.Tensor | None = None,
                 hi: torch.Tensor | None = None) -> torch.Tensor:
    """Asymmetric fake quantization with one (scale, zp) per index of dim 0 (a sequence of a batch: MambaQuant's
    dynamic per-sequence activations, has_batch_dim=True, quantizer.py:273-285; or a weight's output row,
    granularity dim0), from that index's min and max over every other dim (or the given clip range)."""
    dims = tuple(range(1, x.dim()))
    x = x.to(torch.float32)
    lo = x.amin(dim=dims, keepdim=True) if lo is None else lo
    hi = x.amax(dim=dims, keepdim=True) if hi is None else hi
    scale, zp = asym_params(lo, hi, bits)
    return fq_asym(x, scale, zp, bits)


def fq_asym_rows_ref(x: torch.Tensor, bits: int) -> torch.Tensor:
    rows = []
    for row in x.to(torch.float32):
        lo, hi = torch.tensor(min(row.reshape(-1).tolist())), torch.tensor(max(row.reshape(-1).tolist()))
        scale, zp = asym_params(lo, hi, bits)
        rows.append(fq_asym_ref(row, float(scale), float(zp), bits))
    return torch.stack(rows)


def percentile_clip_rows(w: torch.Tensor, percent: float = 0.999999) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output row the (1 - percent, percent) quantiles of its values, (rows, 1, ...) each: the clip range of
    MambaQuant's PercentileObserver (hist_observers.py:11-68, there by a 2048-bin histogram)."""
    flat = w.reshape(w.shape[0], -1).to(torch.float64)
    q = torch.quantile(flat, torch.tensor([1.0 - percent, percent], dtype=torch.float64), dim=1)
    shape = (w.shape[0],) + (1,) * (w.dim() - 1)
    return q[0].to(torch.float32).reshape(shape), q[1].to(torch.float32).reshape(shape)


def fq_sym_codes(x: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """QuaRot's sym_quant_dequant: s * clamp(RNE(x / s), -2^(n-1), 2^(n-1) - 1) (MambaQuant@a4803c4
    quantize/gptq.py, the WeightQuantizer's symmetric branch)."""
    return fq_sym(x, scale, bits)


def _sym_scale(lo: torch.Tensor, hi: torch.Tensor, maxq: int) -> torch.Tensor:
    return torch.maximum(lo.clip(max=0) / (-maxq - 1), hi.clip(min=1e-6) / maxq)


def sym_mse_scales(w: torch.Tensor, bits: int, norm: float = 2.4, grid: int = 100,
                   maxshrink: float = 0.8) -> torch.Tensor:
    """Per output row the symmetric scale of MambaQuant's GPTQ WeightQuantizer (perchannel, sym, mse=True;
    quantize/gptq.py:319-372): scale = max(min(w, 0) / (-maxq - 1), max(w, 0) / maxq), then the shrink p in
    1, 0.99, ..., 0.21 minimizing sum |fq(w) - w|^2.4 per row. (rows, 1) fp32."""
    w = w.reshape(w.shape[0], -1).to(torch.float32)
    maxq = 2 ** (bits - 1) - 1
    zero = torch.zeros(w.shape[0])
    lo, hi = torch.minimum(w.min(1)[0], zero), torch.maximum(w.max(1)[0], zero)
    best, scale = torch.full((w.shape[0],), float("inf")), _sym_scale(lo, hi, maxq)
    for i in range(int(maxshrink * grid)):
        p = 1 - i / grid
        s1 = _sym_scale(p * lo, p * hi, maxq)
        err = (fq_sym(w, s1[:, None], bits) - w).abs().pow(norm).sum(1)
        better = err < best
        best, scale = torch.where(better, err, best), torch.where(better, s1, scale)
    return scale[:, None]


def sym_mse_scales_ref(w: torch.Tensor, bits: int) -> torch.Tensor:
    out = []
    for row in w.to(torch.float32):
        best, pick = float("inf"), None
        maxq = 2 ** (bits - 1) - 1
        lo, hi = min(float(row.min()), 0.0), max(float(row.max()), 0.0)
        for i in range(80):
            p = 1 - i / 100
            s = _sym_scale(torch.tensor(p * lo), torch.tensor(p * hi), maxq)
            err = float((fq_sym(row, s, bits) - row).abs().pow(2.4).sum())
            if err < best:
                best, pick = err, float(s)
        out.append(pick)
    return torch.tensor(out, dtype=torch.float32)[:, None]
