"""Number formats as fake quantization: ``fake_quantize(x, fmt)`` rounds a float32 tensor onto a format's
grid and hands the real values back in float32 (same shape, ``x`` never modified).

The definitions, bit for bit, are ../shared/reference/formats.md (docs/formats.md has the table):

* ``bf16``, ``fp16``: a cast and back (RNE, overflow -> inf);
* ``fp8_e4m3``, ``fp8_e5m2``: per-tensor absmax scale s = fl32(amax / FMAX), saturating RNE cast of x / s;
* ``mx*``: OCP MX v1.0 blocks of 32 with an E8M0 scale, = torchao 0.18.0 ``MXTensor.to_mx(...).dequantize``
  (FLOOR scale, torchao/prototype/mx_formats/mx_tensor.py:247-375 quantize, :414-472 dequantize);
* ``nvfp4``: torchao 0.18.0 ``NVFP4Tensor.to_nvfp4`` with the per-tensor scale amax / 2688
  (nvfp4_tensor.py:756-853, dequantize :199-256); ``nvfp4_noglobal`` without it;
* ``hifp8``: Huawei HiFloat8, a raw cast (no scale), round to nearest with ties away from zero;
* ``int8``, ``int8_g128``: symmetric absmax per tensor / per 128 last-dim elements, s = fl32(a / 127);
* ``int4_g128``: Quamba's GPTQ W4 quantizer (enyac-group/Quamba @c474646 quamba/gptq_utils.py:65-85):
  s = fl32(a * fl32(2/15)), zero point 8, codes 0..15.

Every step is one float32 operation in the order the definitions give; powers of two are built from their
bits, so the arithmetic is exact where the definitions say so and identical on every CPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..spec import FORMAT_NAMES
from .rounding import round_half_away, round_half_even

__all__ = ["Format", "FORMATS", "fake_quantize", "fake_quantize_with_limit", "format_names", "check_shape", "pow2", "scale_groups"]


Limit = Callable[[], torch.Tensor]  # computes, when asked, the largest magnitude of each element's scale group


@dataclass(frozen=True)
class Format:
    """One number format: its scale group along the last dim (0 = no groups), element type, scale rule and
    the bits it stores per value (element plus its share of the group's scale)."""

    name: str
    block: int
    element: str
    scale: str
    bits: float


def _fmt(name: str, block: int, element: str, scale: str, bits: float) -> tuple[str, Format]:
    return name, Format(name, block, element, scale, bits)


FORMATS: dict[str, Format] = dict([
    _fmt("bf16", 0, "bf16 (E8M7)", "none (cast)", 16.0),
    _fmt("fp16", 0, "fp16 (E5M10)", "none (cast)", 16.0),
    _fmt("fp8_e4m3", 0, "fp8 E4M3FN (max 448)", "per tensor, fp32 amax/448", 8.0),
    _fmt("fp8_e5m2", 0, "fp8 E5M2 (max 57344)", "per tensor, fp32 amax/57344", 8.0),
    _fmt("mxfp8_e4m3", 32, "fp8 E4M3FN", "E8M0 per 32 (OCP MX, floor)", 8.25),
    _fmt("mxfp8_e5m2", 32, "fp8 E5M2", "E8M0 per 32 (OCP MX, floor)", 8.25),
    _fmt("mxfp6_e2m3", 32, "fp6 E2M3 (max 7.5)", "E8M0 per 32 (OCP MX, floor)", 6.25),
    _fmt("mxfp6_e3m2", 32, "fp6 E3M2 (max 28)", "E8M0 per 32 (OCP MX, floor)", 6.25),
    _fmt("mxfp4_e2m1", 32, "fp4 E2M1 (max 6)", "E8M0 per 32 (OCP MX, floor)", 4.25),
    _fmt("nvfp4", 16, "fp4 E2M1", "E4M3 per 16 x fp32 per tensor (amax/2688)", 4.5),
    _fmt("nvfp4_noglobal", 16, "fp4 E2M1", "E4M3 per 16", 4.5),
    _fmt("hifp8", 0, "HiFloat8 (tapered, 2^-22..32768)", "none (raw cast, ties away)", 8.0),
    _fmt("int8", 0, "int8 [-127, 127]", "per tensor, fp32 amax/127", 8.0),
    _fmt("int8_g128", 128, "int8 [-127, 127]", "fp32 amax/127 per 128", 8.25),
    _fmt("int4_g128", 128, "int4 [0, 15] - 8", "fp32 amax*(2/15) per 128 (Quamba GPTQ)", 4.25),
])


assert tuple(FORMATS) == FORMAT_NAMES, "spec.FORMAT_NAMES must name exactly the formats implemented here"


def format_names() -> list[str]:
    return list(FORMATS)


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2**e in float32 for integer e in [-149, 127], exact (built from its bits; subnormals included)."""
    e = e.to(torch.int32)
    normal = ((e.clamp(-126, 127) + 127) << 23).view(torch.float32)
    subnormal = (torch.ones_like(e) << (e.clamp(-149, -127) + 149)).view(torch.float32)
    return torch.where(e >= -126, normal, subnormal)


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2 |a|) as int32 for finite nonzero float32 a (frexp is exact); 0 and non-finite give junk."""
    return torch.frexp(a)[1] - 1


def _minifloat(v: torch.Tensor, mbits: int, emin: int, vmax: float) -> torch.Tensor:
    """RNE of float32 v onto a float grid with `mbits` mantissa bits, smallest normal exponent `emin`
    (subnormals below it) and largest value `vmax`; saturating (+-inf -> +-vmax), NaN stays NaN.

    The quantum of |v|'s binade is a power of two, so |v| / quantum and the product back are exact."""
    a = v.abs()
    emax = int(torch.tensor(vmax).frexp()[1]) - 1
    quantum = pow2(_floor_log2(a).clamp(emin, emax) - mbits)
    q = (round_half_even(a / quantum) * quantum).clamp(max=vmax)
    return torch.copysign(q, v)


# element -> (mantissa bits, smallest normal exponent, max, emax for the MX scale)
_ELEMENTS: dict[str, tuple[int, int, float, int]] = {
    "e4m3": (3, -6, 448.0, 8), "e5m2": (2, -14, 57344.0, 15), "e2m3": (3, 0, 7.5, 2),
    "e3m2": (2, -2, 28.0, 4), "e2m1": (1, 0, 6.0, 2),
}
_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _element(v: torch.Tensor, elem: str) -> torch.Tensor:
    """Saturating RNE onto the element grid: the torch fp8 cast after a clamp (torchao's path), or the grid."""
    mbits, emin, vmax, _ = _ELEMENTS[elem]
    if elem in _FP8:
        return v.clamp(-vmax, vmax).to(_FP8[elem]).to(torch.float32)
    return _minifloat(v, mbits, emin, vmax)


def scale_groups(x: torch.Tensor, block: int) -> torch.Tensor:
    """x: (..., n) -> (..., n // block, block), contiguous (a copy when x is not)."""
    return x.contiguous().reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _mx(x: torch.Tensor, elem: str) -> tuple[torch.Tensor, Limit]:
    """OCP MX block of 32, E8M0 scale by torchao's FLOOR rule (module docstring)."""
    emax = _ELEMENTS[elem][3]
    b = scale_groups(x, 32)
    amax = b.abs().amax(-1, keepdim=True)
    biased = ((amax.view(torch.int32) >> 23) & 0xFF) - 127 - emax
    byte = biased.clamp(-127, 128) + 127
    q = _element(b / pow2(byte.clamp(min=1) - 127), elem)   # torchao divides by 2^max(b-127, -126)
    mult = torch.where(amax.isnan(), torch.nan, pow2(byte - 127))  # ... and multiplies by 2^(b-127); NaN: byte 255
    limit = _ELEMENTS[elem][2] * pow2(byte.clamp(min=1) - 127)
    return (q * mult).reshape(x.shape), lambda: limit.expand(b.shape).reshape(x.shape)


_E4M3_TINY = 2.0 ** -6  # torch.finfo(torch.float8_e4m3fn).tiny, torchao's E4M3_EPS (nvfp4_tensor.py:39)


def _e4m3(v: torch.Tensor) -> torch.Tensor:
    return v.clamp(_E4M3_TINY, 448.0).to(torch.float8_e4m3fn).to(torch.float32)


def _nvfp4(x: torch.Tensor, global_scale: bool) -> tuple[torch.Tensor, Limit]:
    b = scale_groups(x, 16)
    amax = b.abs().amax(-1, keepdim=True)
    if not global_scale:
        sb = _e4m3(amax / 6.0)
        q = _element((b * (1.0 / sb)).clamp(-6.0, 6.0), "e2m1")
        return (q * sb).reshape(x.shape), lambda: (6.0 / (1.0 / sb)).expand(b.shape).reshape(x.shape)
    p = (x.abs().amax() / 2688.0).to(torch.float32)  # per_tensor_amax_to_scale: amax / (448 * 6)
    if p == 0:  # all zeros, or amax so small the scale underflows: zeros (torchao: 0/0 = NaN)
        return torch.zeros_like(x), lambda: torch.zeros_like(x)
    sb = _e4m3((amax / 6.0) / p)
    r = (1.0 / p) / sb
    q = _element((b * r).clamp(-6.0, 6.0), "e2m1")
    return (q * (p * sb)).reshape(x.shape), lambda: (6.0 / r).expand(b.shape).reshape(x.shape)


def _fp8(x: torch.Tensor, elem: str) -> tuple[torch.Tensor, Limit]:
    fmax = _ELEMENTS[elem][2]
    s = x.abs().amax() / fmax
    if s == 0:
        return torch.zeros_like(x), lambda: torch.zeros_like(x)
    return _element(x / s, elem) * s, lambda: (fmax * s).expand(x.shape)


def _int(x: torch.Tensor, block: int, int4: bool) -> tuple[torch.Tensor, Limit]:
    """Symmetric int8 (s = a / 127) or Quamba's int4 (s = a * fl32(2/15), zero point 8), per group of
    `block` last-dim elements (block 0: the whole tensor). A group whose scale is 0 gives zeros."""
    g = scale_groups(x, block) if block else x.reshape(1, -1)
    a = g.abs().amax(-1, keepdim=True)
    s = a * torch.tensor(2.0 / 15.0, dtype=torch.float32) if int4 else a / 127.0
    r = round_half_even(g / s)
    q = (r + 8.0).clamp(0.0, 15.0) - 8.0 if int4 else r.clamp(-127.0, 127.0)
    y = torch.where(s == 0, 0.0, q * s).reshape(x.shape)
    return y, lambda: (torch.where(g < 0, 8.0, 7.0) * s if int4 else 127.0 * s).expand(g.shape).reshape(x.shape)


# HiFloat8 mantissa bits per binade exponent E = -23 .. 15 (formats.md "hifp8"): the 7 denormal binades
# 2^-22 .. 2^-16 (and 2^-23 below them, which only rounds to 0 or 2^-22) carry no mantissa bit;
# |E| 8..15: 1 bit, 4..7: 2 bits, 0..3: 3 bits.
_HIF8_EMIN, _HIF8_MAX, _HIF8_INF_AT = -22, 32768.0, 40960.0
_HIF8_MBITS = torch.tensor([0] * 7 + [1 if abs(e) >= 8 else 2 if abs(e) >= 4 else 3 for e in range(-15, 16)],
                           dtype=torch.int32)


def _hifp8(x: torch.Tensor) -> torch.Tensor:
    """Raw cast to HiFloat8 and back: nearest code, ties away from zero; |x| >= 40960 -> inf; -0 -> +0."""
    a = x.abs()
    e = _floor_log2(a).clamp(_HIF8_EMIN, 15)
    quantum = pow2(e - _HIF8_MBITS[e - _HIF8_EMIN])
    q = round_half_away(a / quantum) * quantum
    q = torch.where((q > _HIF8_MAX) | (a >= _HIF8_INF_AT), torch.inf, q)
    return torch.where(q == 0, 0.0, torch.copysign(q, x))


def check_shape(x: torch.Tensor, fmt: str) -> None:
    """ValueError unless `fmt` is a format and x (rank >= 1) fits its scale groups."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; valid: {', '.join(FORMATS)}")
    if x.dim() < 1:
        raise ValueError(f"format {fmt}: x must have rank >= 1, got a scalar")
    block = FORMATS[fmt].block
    if block and x.shape[-1] % block:
        raise ValueError(f"format {fmt}: the last dimension ({x.shape[-1]}) is not a multiple of its "
                         f"block size {block}")


def fake_quantize(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x rounded onto format `fmt` and back: a new float32 tensor of x's shape (x itself is not modified).

    x: (..., n) float32, any strides; n a multiple of the format's block (FORMATS[fmt].block) where it
    has one, else ValueError naming the format and the size."""
    return _quantize(x, fmt)[0]


_CAST_MAX = {"bf16": float(torch.finfo(torch.bfloat16).max), "fp16": 65504.0, "hifp8": _HIF8_MAX}


def fake_quantize_with_limit(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(fake_quantize(x, fmt), the largest magnitude each element's scale group can represent), both of x's
    shape: |x| above the limit saturates (scaled formats) or overflows (the casts; for int4_g128 the limit
    is 8s below zero and 7s above). A group whose scale is 0 has limit 0."""
    y, limit = _quantize(x, fmt)
    return y, limit()


def _quantize(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, Limit]:
    check_shape(x, fmt)
    if x.dtype != torch.float32:
        raise ValueError(f"format {fmt}: x must be float32, got {x.dtype}")
    if fmt in _CAST_MAX:
        y = _hifp8(x) if fmt == "hifp8" else x.to(torch.bfloat16 if fmt == "bf16" else torch.float16).to(torch.float32)
        return y, lambda: torch.full_like(y, _CAST_MAX[fmt])
    if fmt.startswith("fp8_"):
        return _fp8(x, fmt[4:])
    if fmt.startswith("mxfp"):
        return _mx(x, fmt.split("_")[1])
    if fmt.startswith("nvfp4"):
        return _nvfp4(x, global_scale=fmt == "nvfp4")
    return _int(x, FORMATS[fmt].block, int4=fmt == "int4_g128")
