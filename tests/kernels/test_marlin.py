"""Marlin (W4A16) and Marlin-QQQ (W4A8) unpacking against weights packed here as Quamba packs them
(enyac-group/Quamba c474646 quamba/marlin_utils.py, written out below from the source, not through the harness)."""
from __future__ import annotations

import pytest
import torch

from harness.kernels.int4 import Int4Weight
from harness.kernels.marlin import unpack_marlin, unpack_marlin_qqq, unpack_marlin_qqq_ref, unpack_marlin_ref
from marlin_fixture import quamba_pack as _quamba_pack, quamba_perm as _quamba_perm, scale_perms as _scale_perms


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


@pytest.mark.parametrize("qqq, out, k", [(False, 300, 384), (False, 256, 256), (True, 150, 256), (True, 64, 384)])
def test_pack_equals_quambas_packing_and_unpacks_back(qqq, out, k):
    """The W4 export's packing gives the tensors the test packs from Quamba's source (pack_given, with its padding)
    and the unpacking gives the weight back."""
    from harness.kernels.marlin import pack_marlin, pack_marlin_qqq
    from marlin_fixture import pack_given

    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 16, (out, k), generator=g).to(torch.uint8)
    codes[0, :8] = 15  # the top nibble set: words that are negative as int32
    groups = (torch.rand(out, k // 128, generator=g) + 0.5).to(torch.float16)
    channel = (torch.rand(out, generator=g) * 0.01 + 1e-3) if qqq else None
    w = Int4Weight(codes, groups, channel)
    want = pack_given(codes, groups, channel)
    if qqq:
        weight, s_group, s_channel = pack_marlin_qqq(w)
        assert torch.equal(weight, want["weight"]) and torch.equal(s_group, want["s_group"])
        assert torch.equal(s_channel, want["s_channel"])
        back = unpack_marlin_qqq(weight, s_group, s_channel, out)
        assert torch.equal(back.channel_scales, channel)
    else:
        weight, scale = pack_marlin(w)
        assert torch.equal(weight, want["weight"]) and torch.equal(scale, want["scale"])
        back = unpack_marlin(weight, scale, out)
    assert torch.equal(back.codes, codes) and torch.equal(back.group_scales, groups)
