"""Marlin (W4A16) and Marlin-QQQ (W4A8) packed int4 weights unpacked into ``Int4Weight`` (pure ops, no GPU).

The packing, enyac-group/Quamba c474646 quamba/marlin_utils.py, of codes q [K, N] (K in-features, N
out-features padded to a multiple of 256 for W4A16, 64 for W4A8, qLinearLayer.py:24-26, 150-152, 289-291):

1. tiles (``permute_weights``, :33-45): q.reshape(K/16, 16, N/16, 16).permute(0, 2, 1, 3).reshape(K/16, 16N),
   then every run of 1024 values is permuted: ``row[:, perm]``; perm is ``get_w4a16_weight_perms`` (:371-391) or
   ``get_w4a8_weight_perm`` (:75-105; per-group interleave [0 2 4 6 1 3 5 7]);
2. packing (:59-66, :293-296): eight consecutive values into one int32, value 8j+i in bits 4i..4i+3 of word j:
   a weight tensor [K/16, 2N] int32;
3. scales (``get_scale_perms`` :109-117): the group scales [K/g, N] fp16 permuted in runs of 64 by
   ``scale_perm``, W4A8's channel scales [1, N] fp32 in runs of 32 by ``scale_perm_single``.

Per group (group 128, GPTQ's, :153-191): code = clamp(round(w / s) + 8, 0, 15) (uint4, zero point 8). W4A16 keeps
the fp16 group scale s; W4A8 stores s / s_channel in fp16 (``s_group``) and the fp32 ``s_channel``. The unpacking
inverts 1-3 exactly (integer codes and stored scales, nothing rounded) and drops the padded out-features; the
packing (``pack_marlin``, ``pack_marlin_qqq``, for the W4 export) applies them to an ``Int4Weight``, padding the
out-features with code 0, group scale 0 and (QQQ) channel scale 1e-6 as ``w4a8_quantize`` pads (:258-262).
Per-channel packing (K <= 128, group_size -1: signed codes, another interleave) is refused.
"""
from __future__ import annotations

import numpy as np
import torch

from .int4 import Int4Weight

__all__ = ["w4a16_weight_perm", "w4a8_weight_perm", "scale_perms", "unpack_marlin", "unpack_marlin_ref",
           "unpack_marlin_qqq", "unpack_marlin_qqq_ref", "pack_marlin", "pack_marlin_qqq"]

_TILE, _PACK = 16, 8


def _thread_rows(i: int, w4a16: bool) -> list[int]:
    """The four rows thread i reads: W4A16 marlin_utils.py:377-382, W4A8 :81-86."""
    if w4a16:
        return [2 * (i % 4), 2 * (i % 4) + 1, 2 * (i % 4 + 4), 2 * (i % 4 + 4) + 1]
    return [4 * (i % 4) + r for r in range(4)]


def _tile_perm(w4a16: bool) -> np.ndarray:
    """The 1024-entry permutation of both Marlin variants (then the per-group interleave of eight)."""
    perm = []
    for i in range(32):
        col = i // 4
        one = [16 * row + col + 8 * block for block in (0, 1) for row in _thread_rows(i, w4a16)]
        for j in range(4):
            perm.extend(p + 256 * j for p in one)
    return np.array(perm).reshape(-1, 8)[:, [0, 2, 4, 6, 1, 3, 5, 7]].ravel()


def w4a16_weight_perm() -> torch.Tensor:
    return torch.from_numpy(_tile_perm(True))


def w4a8_weight_perm() -> torch.Tensor:
    """Per-group Marlin-QQQ permutation (marlin_utils.py:75-105 with quant_type "per-group")."""
    return torch.from_numpy(_tile_perm(False))


def scale_perms() -> tuple[list[int], list[int]]:
    """(scale_perm, scale_perm_single) of marlin_utils.py:109-117."""
    return [i + 8 * j for i in range(8) for j in range(8)], \
        [2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)]


def _inverse(perm: torch.Tensor | list[int]) -> torch.Tensor:
    perm = torch.as_tensor(perm, dtype=torch.int64)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel())
    return inv


def _unpack_codes(packed: torch.Tensor, k: int, n: int, perm: torch.Tensor) -> torch.Tensor:
    """[K/16, 2N] int32 -> codes [K, N] uint8 (steps 1-2 inverted)."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    flat = torch.empty(words.shape[0], words.shape[1] * _PACK, dtype=torch.int64)
    for i in range(_PACK):
        flat[:, i::_PACK] = (words >> (4 * i)) & 0xF
    flat = flat.reshape(-1, perm.numel())[:, _inverse(perm)].reshape(k // _TILE, n * _TILE)
    return flat.reshape(k // _TILE, n // _TILE, _TILE, _TILE).permute(0, 2, 1, 3).reshape(k, n).to(torch.uint8)


def _unperm_rows(t: torch.Tensor, perm: list[int], n: int) -> torch.Tensor:
    return t.reshape(-1, len(perm))[:, _inverse(perm)].reshape(-1, n)


def _check(packed: torch.Tensor, k: int, n: int, group_size: int) -> None:
    if group_size >= k or k % group_size or k % _TILE or n % 64:
        raise ValueError(f"Marlin per-group packing needs in_features ({k}) a multiple of the group size "
                         f"({group_size}, below in_features) and of 16, padded out_features ({n}) a multiple of 64")
    if packed.dtype != torch.int32 or tuple(packed.shape) != (k // _TILE, n * _TILE // _PACK):
        raise ValueError(f"packed weight is {packed.dtype} {list(packed.shape)}, expected int32 "
                         f"{[k // _TILE, n * _TILE // _PACK]}")


def unpack_marlin(packed: torch.Tensor, scale: torch.Tensor, out_features: int, group_size: int = 128) -> Int4Weight:
    """W4A16B16O16Linear's ``weight`` [K/16, 2N] int32 and ``scale`` [K/g, N] fp16 -> Int4Weight [out, K]."""
    k, n = packed.shape[0] * _TILE, scale.shape[1]
    _check(packed, k, n, group_size)
    codes = _unpack_codes(packed, k, n, w4a16_weight_perm())
    s = _unperm_rows(scale, scale_perms()[0], n)
    return Int4Weight(codes.t()[:out_features].contiguous(), s.t()[:out_features].to(torch.float16).contiguous(), None,
                      group_size)


def unpack_marlin_qqq(packed: torch.Tensor, s_group: torch.Tensor, s_channel: torch.Tensor, out_features: int,
                      group_size: int = 128) -> Int4Weight:
    """W4A8's ``weight`` [K/16, 2N] int32, ``s_group`` [K/g, N] fp16 (s / s_channel), ``s_channel`` [1, N] fp32
    -> Int4Weight [out, K] with group_scales s_group and channel_scales s_channel."""
    k, n = packed.shape[0] * _TILE, s_group.shape[1]
    _check(packed, k, n, group_size)
    codes = _unpack_codes(packed, k, n, w4a8_weight_perm())
    single = scale_perms()[1]
    sg = _unperm_rows(s_group, scale_perms()[0], n)
    sc = _unperm_rows(s_channel, single, n).reshape(-1)
    return Int4Weight(codes.t()[:out_features].contiguous(), sg.t()[:out_features].to(torch.float16).contiguous(),
                      sc[:out_features].to(torch.float32).contiguous(), group_size)


def _ref_codes(packed: torch.Tensor, k: int, n: int, perm: torch.Tensor) -> torch.Tensor:
    """Oracle: each (row, col) followed forward through the packing to its word and nibble, one at a time."""
    words, p = packed.numpy().astype(np.int64) & 0xFFFFFFFF, perm.tolist()
    where = {v: j for j, v in enumerate(p)}  # position after the permutation of the value at position v
    out = np.zeros((k, n), dtype=np.uint8)
    for r in range(k):
        for c in range(n):
            flat = ((c // _TILE) * _TILE + (r % _TILE)) * _TILE + c % _TILE  # index in the tiled row r // 16
            block, off = divmod(flat, len(p))
            pos = block * len(p) + where[off]
            out[r, c] = (words[r // _TILE, pos // _PACK] >> (4 * (pos % _PACK))) & 0xF
    return torch.from_numpy(out)


def _ref_scales(t: torch.Tensor, perm: list[int], n: int) -> torch.Tensor:
    flat, out = t.reshape(-1), torch.empty(t.numel(), dtype=t.dtype)
    for j in range(t.numel()):
        block, off = divmod(j, len(perm))
        out[block * len(perm) + perm[off]] = flat[j]
    return out.reshape(-1, n)


def unpack_marlin_ref(packed: torch.Tensor, scale: torch.Tensor, out_features: int, group_size: int = 128) -> Int4Weight:
    k, n = packed.shape[0] * _TILE, scale.shape[1]
    codes, s = _ref_codes(packed, k, n, w4a16_weight_perm()), _ref_scales(scale, scale_perms()[0], n)
    return Int4Weight(codes.t()[:out_features].contiguous(), s.t()[:out_features].contiguous(), None, group_size)


def unpack_marlin_qqq_ref(packed: torch.Tensor, s_group: torch.Tensor, s_channel: torch.Tensor, out_features: int,
                          group_size: int = 128) -> Int4Weight:
    k, n = packed.shape[0] * _TILE, s_group.shape[1]
    codes = _ref_codes(packed, k, n, w4a8_weight_perm())
    sg, sc = _ref_scales(s_group, scale_perms()[0], n), _ref_scales(s_channel, scale_perms()[1], n).reshape(-1)
    return Int4Weight(codes.t()[:out_features].contiguous(), sg.t()[:out_features].contiguous(),
                      sc[:out_features].contiguous(), group_size)


def _pack_codes(codes: torch.Tensor, n: int, perm: torch.Tensor) -> torch.Tensor:
    """codes [out, K] uint8 -> [K/16, 2N] int32 (steps 1-2; out-features padded to n with code 0)."""
    out, k = codes.shape
    q = torch.zeros(k, n, dtype=torch.int64)
    q[:, :out] = codes.t().to(torch.int64)
    q = q.reshape(k // _TILE, _TILE, n // _TILE, _TILE).permute(0, 2, 1, 3).reshape(k // _TILE, n * _TILE)
    q = q.reshape(-1, perm.numel())[:, perm].reshape(k // _TILE, n * _TILE)
    words = torch.zeros(q.shape[0], q.shape[1] // _PACK, dtype=torch.int64)
    for i in range(_PACK):
        words |= q[:, i::_PACK] << (4 * i)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _perm_rows(t: torch.Tensor, perm: list[int], n: int) -> torch.Tensor:
    return t.reshape(-1, len(perm))[:, torch.as_tensor(perm)].reshape(-1, n).contiguous()


def _padded_groups(w: Int4Weight, n: int) -> torch.Tensor:
    g = torch.zeros(w.codes.shape[1] // w.group_size, n, dtype=torch.float16)
    g[:, :w.codes.shape[0]] = w.group_scales.t().to(torch.float16)
    return g


def pack_marlin(w: Int4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """Int4Weight [out, K] -> W4A16B16O16Linear's ``weight`` [K/16, 2N] int32 and ``scale`` [K/g, N] fp16, N the
    out-features padded to 256 (qLinearLayer.py:24-26)."""
    n = -(-w.codes.shape[0] // 256) * 256
    k = w.codes.shape[1]
    _check(torch.zeros(k // _TILE, n * _TILE // _PACK, dtype=torch.int32), k, n, w.group_size)
    return _pack_codes(w.codes, n, w4a16_weight_perm()), _perm_rows(_padded_groups(w, n), scale_perms()[0], n)


def pack_marlin_qqq(w: Int4Weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Int4Weight [out, K] with channel scales -> Marlin-QQQ's ``weight`` [K/16, 2N] int32, ``s_group`` [K/g, N]
    fp16 and ``s_channel`` [1, N] fp32, N the out-features padded to 64 (qLinearLayer.py:150-152)."""
    assert w.channel_scales is not None, "Marlin-QQQ needs the channel scales"
    out, k = w.codes.shape
    n = -(-out // 64) * 64
    _check(torch.zeros(k // _TILE, n * _TILE // _PACK, dtype=torch.int32), k, n, w.group_size)
    ch = torch.full((1, n), 1e-6, dtype=torch.float32)
    ch[0, :out] = w.channel_scales.to(torch.float32)
    return _pack_codes(w.codes, n, w4a8_weight_perm()), _perm_rows(_padded_groups(w, n), scale_perms()[0], n), \
        _perm_rows(ch, scale_perms()[1], n)
