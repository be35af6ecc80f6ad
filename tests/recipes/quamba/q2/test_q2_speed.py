"""Two hot spots of the q2-w8a8 path made faster (docs/performance.md "Mamba-2"): each result unchanged bit for bit."""
from __future__ import annotations

import math

import pytest
import torch

from harness.kernels import hadamard as H
from harness.kernels.conv1d_grouped import x_channel_scales, x_channel_scales_ref


def _out_of_place(x: torch.Tensor, normalized: bool, transpose: bool) -> torch.Tensor:
    """hadamard_transform as it was written before: a temporary per term, a scaled copy."""
    n = x.shape[-1]
    b, m = H.hadamard_factors(n)
    y = H._butterflies(x, torch.float64, b, m)
    if b > 1:
        base = H._base_matrix(b)
        signs = (base.t() if transpose else base)[:, :, None]
        acc = y[:, None, 0, :] * signs[:, 0]
        for d in range(1, b):
            acc = acc + y[:, None, d, :] * signs[:, d]
        y = acc
    y = y.reshape(*x.shape[:-1], n)
    return y * (1.0 / math.sqrt(n)) if normalized else y


@pytest.mark.parametrize("n", [64, 12 * 16, 20 * 4, 28 * 2, 40 * 8, 768])
def test_hadamard_in_place_is_bit_identical(n):
    g = torch.Generator().manual_seed(n)
    for x in (torch.randn(3, 5, n, generator=g), torch.randn(7, n, generator=g).to(torch.float16),
              torch.randn(4, n, generator=g, dtype=torch.float64) * 1e3):
        before = x.clone()
        for normalized in (True, False):
            for transpose in (True, False):
                got, want = H.hadamard_transform(x, normalized, transpose), _out_of_place(x, normalized, transpose)
                assert got.shape == want.shape and torch.equal(got.view(torch.int64), want.view(torch.int64))
        assert torch.equal(x, before)  # the input is never written


def test_x_channel_scales_equals_its_loop_on_random_groupings():
    """Random group boundaries per SSD group and head group, including ranges that leave channels outside
    every group (scale 0, as the kernel leaves them) and empty groups."""
    g = torch.Generator().manual_seed(3)
    for ngroups, heads, headdim in ((1, 8, 4), (2, 6, 5), (3, 4, 8)):
        for _ in range(20):
            head_range = torch.sort(torch.randint(0, heads + 2, (ngroups, 4), generator=g), dim=1).values.to(torch.int32)
            dim_range = torch.sort(torch.randint(0, headdim + 2, (ngroups, 4, 4), generator=g), dim=2).values.to(torch.int32)
            table = torch.rand(ngroups, 4, 4, generator=g) + 0.01
            x_dim = ngroups * heads * headdim
            got = x_channel_scales(table, head_range, dim_range, x_dim, headdim)
            want = x_channel_scales_ref(table, head_range, dim_range, x_dim, headdim)
            assert got.dtype == torch.float32 and torch.equal(got, want)
