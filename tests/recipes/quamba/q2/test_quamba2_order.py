"""The channel and head order of a Quamba2 checkpoint recovered from its float model
(harness.recipes.quamba.q2.order): the permutation found back, and the summary's fractions matched."""
from __future__ import annotations

import pytest
import torch

from harness.checkpoints.loading import open_checkpoint
from harness.recipes.quamba.q2.order import recover_order, recover_order_w4
from harness.architectures.mamba2.weights import float_layer_mamba2
from harness.recipes.quamba.q2.weights import q2_in_proj_weight
from mamba2_fixtures import make_mamba2


@pytest.fixture(scope="module")
def layer(tmp_path_factory):
    """(raw block 0 of a seeded Mamba-2 with d_inner 64 and 8 heads, its dims, its fp16 prepared layer)."""
    path = tmp_path_factory.mktemp("order") / "m"
    make_mamba2(path, layers=1, seed=5)
    ckpt = open_checkpoint(path)
    raw = ckpt.raw_layer(0)
    return raw, ckpt.dims, float_layer_mamba2(raw, True, torch.float16)


def test_w8a8_order_is_the_permutation_and_the_summary_counts_exact_rows(layer):
    """The checkpoint's in_proj rows are the float model's codes with channels (z and x rows together) and
    heads (dt rows) permuted; one x row is one code off (a GPU's rounding): it is still paired, by distance,
    and the summary counts 63 of 64 channels and 8 of 8 heads matched exactly."""
    raw, d, p = layer
    E, bc, H = d.d_inner, d.ngroups * d.d_state, d.nheads
    codes = q2_in_proj_weight(p.in_proj, [E, E, bc, bc, H], [1.0] * 5)[0]
    g = torch.Generator().manual_seed(1)
    ch, hd = torch.randperm(E, generator=g), torch.randperm(H, generator=g)
    ckpt = torch.cat([codes[:E][ch], codes[E:2 * E][ch], codes[2 * E:-H], codes[-H:][hd]])
    ckpt[E + 5, 0] = ckpt[E + 5, 0] + (1 if ckpt[E + 5, 0] < 127 else -1)
    channels, heads, summary = recover_order(ckpt, raw, d)
    assert torch.equal(channels, ch) and torch.equal(heads, hd)
    assert summary == {"channels_exact": round(63 / 64, 6), "heads_exact": 1.0}


def test_w4a16_keeps_the_order_and_counts_the_rows_equal_to_the_float_model(layer):
    """W4A16 is not reordered: the identity, with the fraction of conv1d rows and of dt_bias values equal to the
    float model's fp16 ones (here one conv row and one head changed: 63/64 and 7/8)."""
    raw, d, p = layer
    E, H = d.d_inner, d.nheads
    conv, dt_bias = p.conv_weight.to(torch.float16).clone(), p.dt_bias.to(torch.float16).clone()
    conv[3, 1] += 1.0
    dt_bias[2] += 1.0
    tensors = {"conv1d.weight": conv[:, None, :], "dt_bias": dt_bias}
    channels, heads, summary = recover_order_w4(None, "W4A16", tensors, raw, d)
    assert torch.equal(channels, torch.arange(E)) and torch.equal(heads, torch.arange(H))
    assert summary == {"channels_exact": round(63 / 64, 6), "heads_exact": 0.875}
