"""Marlin (W4A16) and Marlin-QQQ (W4A8) unpacking against weights packed here as Quamba packs them
(enyac-group/Quamba c474646 quamba/marlin_utils.py, written out below from the source, not through the harness)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from harness.emulation.ops.int4 import Int4Weight
from harness.emulation.ops.marlin import unpack_marlin, unpack_marlin_qqq, unpack_marlin_qqq_ref, unpack_marlin_ref


def _quamba_perm(w4a16: bool) -> torch.Tensor:
    # get_w4a16_weight_perms (:371-391) / get_w4a8_weight_perm(4, "per-group") (:75-105)
    perm_list = []
    for i in range(32):
        perm1 = []
        col = i // 4
        for block in [0, 1]:
            rows = [2 * (i % 4), 2 * (i % 4) + 1, 2 * (i % 4 + 4), 2 * (i % 4 + 4) + 1] if w4a16 else \
                [4 * (i % 4), 4 * (i % 4) + 1, 4 * (i % 4) + 2, 4 * (i % 4) + 3]
            for row in rows:
                perm1.append(16 * row + col + 8 * block)
        for j in range(4):
            perm_list.extend([p + 256 * j for p in perm1])
    perm = np.array(perm_list)
    interleave = np.array([0, 2, 4, 6, 1, 3, 5, 7])
    return torch.from_numpy(perm.reshape((-1, len(interleave)))[:, interleave].ravel())


def _quamba_pack(q_w: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    # permute_weights (:33-45) then the packing loop (:57-68, :291-298)
    size_k, size_n = q_w.shape
    q_w = q_w.reshape((size_k // 16, 16, size_n // 16, 16)).permute((0, 2, 1, 3)).reshape((size_k // 16, size_n * 16))
    q_w = q_w.reshape((-1, perm.numel()))[:, perm].reshape(q_w.shape)
    q_w = q_w.numpy().astype(np.uint32)
    q_packed = np.zeros((q_w.shape[0], q_w.shape[1] // 8), dtype=np.uint32)
    for i in range(8):
        q_packed |= q_w[:, i::8] << 4 * i
    return torch.from_numpy(q_packed.astype(np.int32))


def _scale_perms():
    # get_scale_perms (:109-117)
    scale_perm = []
    for i in range(8):
        scale_perm.extend([i + 8 * j for j in range(8)])
    scale_perm_single = []
    for i in range(4):
        scale_perm_single.extend([2 * i + j for j in [0, 1, 8, 9, 16, 17, 24, 25]])
    return scale_perm, scale_perm_single


def _codes(k: int, n: int, out: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=g, dtype=torch.int32)
    q[:, out:] = 0  # w4a*_quantize pads q_w with zeros (:258-262, :437-441)
    return q


@pytest.mark.parametrize("k,n,out", [(256, 256, 256), (384, 512, 300)])
def test_unpack_marlin_w4a16(k, n, out):
    q = _codes(k, n, out, 1)
    scale = (torch.rand(k // 128, n, generator=torch.Generator().manual_seed(2)) * 0.1 + 0.01).to(torch.float16)
    packed = _quamba_pack(q, _quamba_perm(True))
    stored = scale.reshape((-1, 64))[:, _scale_perms()[0]].reshape((-1, n)).contiguous()  # w4a16_permute_scales
    w = unpack_marlin(packed, stored, out)
    assert isinstance(w, Int4Weight) and w.shape == (out, k) and w.channel_scales is None
    assert torch.equal(w.codes, q[:, :out].t().to(torch.uint8))
    assert torch.equal(w.group_scales, scale[:, :out].t())
    ref = unpack_marlin_ref(packed, stored, out)
    assert torch.equal(ref.codes, w.codes) and torch.equal(ref.group_scales, w.group_scales)


@pytest.mark.parametrize("k,n,out", [(256, 128, 128), (256, 192, 150)])
def test_unpack_marlin_qqq_w4a8(k, n, out):
    q = _codes(k, n, out, 3)
    g = torch.Generator().manual_seed(4)
    s_group = (torch.rand(k // 128, n, generator=g) + 0.5).to(torch.float16)
    s_channel = (torch.rand(1, n, generator=g) * 0.01 + 1e-3).to(torch.float32)
    packed = _quamba_pack(q, _quamba_perm(False))
    perm, single = _scale_perms()
    sg = s_group.reshape((-1, len(perm)))[:, perm].reshape((-1, n)).contiguous()      # w4a8_permute_scales
    sc = s_channel.reshape((-1, len(single)))[:, single].reshape((-1, n)).contiguous()
    w = unpack_marlin_qqq(packed, sg, sc, out)
    assert torch.equal(w.codes, q[:, :out].t().to(torch.uint8))
    assert torch.equal(w.group_scales, s_group[:, :out].t()) and torch.equal(w.channel_scales, s_channel[0, :out])
    ref = unpack_marlin_qqq_ref(packed, sg, sc, out)
    assert torch.equal(ref.codes, w.codes) and torch.equal(ref.channel_scales, w.channel_scales)


def test_the_two_permutations_differ():
    """W4A8 and W4A16 tiles are not interchangeable: unpacking with the wrong one scrambles the codes."""
    q = _codes(256, 256, 256, 5)
    scale = torch.ones(2, 256, dtype=torch.float16)
    packed = _quamba_pack(q, _quamba_perm(False))
    assert not torch.equal(unpack_marlin(packed, scale, 256).codes, q.t().to(torch.uint8))


def test_per_channel_packing_is_refused():
    with pytest.raises(ValueError, match="group size"):
        unpack_marlin(torch.zeros(8, 256, dtype=torch.int32), torch.ones(1, 128, dtype=torch.float16), 128, 128)
