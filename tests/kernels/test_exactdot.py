"""kernels.exactdot: correctly rounded fp32 products, whatever the order a GEMM sums them in."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from harness.kernels.exactdot import matmul_rn, matmul_rn_ref, round_exact_sum
from harness.kernels.ssd import cumsum_tokens


def _nearest_fp32(exact: Fraction) -> np.float32:
    """The oracle: the fp32 value nearest `exact`, ties to even, by exact rational comparison."""
    r = np.float32(float(exact))
    below = r if Fraction(float(r)) <= exact else np.nextafter(r, np.float32(-np.inf))
    above = np.nextafter(below, np.float32(np.inf))
    lo, hi = Fraction(float(below)), Fraction(float(above))
    if exact - lo != hi - exact:
        return below if exact - lo < hi - exact else above
    return below if int(below.view(np.int32)) % 2 == 0 else above


@pytest.mark.parametrize("products, expected", [
    ([1.0, 2.0 ** -24, 2.0 ** -80], np.float32(1 + 2.0 ** -23)),  # fsum gives the midpoint; the exact sum is above
    ([1.0, 2.0 ** -24, -2.0 ** -80], np.float32(1.0)),            # ... below
    ([1.0, 2.0 ** -24], np.float32(1.0)),                         # a true tie: to even
    ([1.0 + 2.0 ** -23, 2.0 ** -24], np.float32(1 + 2.0 ** -22)),  # a true tie: to even, upwards
    ([3.0, -3.0], np.float32(0.0)),
])
def test_round_exact_sum_decides_the_double_rounding_case(products, expected):
    got = round_exact_sum(products)
    assert got == expected and got == _nearest_fp32(sum(Fraction(p) for p in products))


def test_round_exact_sum_of_opposite_infinities_is_nan():
    assert np.isnan(round_exact_sum([np.inf, -np.inf, 1.0]))
    assert round_exact_sum([np.inf, 1.0]) == np.inf


def test_matmul_rn_is_the_nearest_fp32_of_the_exact_sum():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 7, 33, generator=g), torch.randn(2, 33, 5, generator=g)
    got = matmul_rn(a, b)
    assert torch.equal(got, matmul_rn_ref(a, b))
    exact = [[[_nearest_fp32(sum(Fraction(float(x)) * Fraction(float(y)) for x, y in zip(a[n, i], b[n, :, j])))
               for j in range(5)] for i in range(7)] for n in range(2)]
    assert np.array_equal(got.numpy(), np.array(exact, dtype=np.float32))
    assert not torch.equal(got, torch.matmul(a, b))  # an fp32 GEMM rounds each partial sum: other bits


def test_matmul_rn_does_not_depend_on_the_summation_order():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(3, 64, 256, generator=g), torch.randn(3, 256, 48, generator=g)
    perm = torch.randperm(256, generator=g)
    assert torch.equal(matmul_rn(a[..., perm], b[:, perm]), matmul_rn(a, b))
    assert not torch.equal(torch.matmul(a[..., perm], b[:, perm]), torch.matmul(a, b))


def test_matmul_rn_decides_sums_near_a_midpoint_exactly():
    # rows whose exact sums sit a hair above or below a midpoint between two fp32 values: the float64 GEMM cannot
    # tell which side, so these take the exact path, and must still be the nearest fp32 value
    a = torch.tensor([[1.0, 2.0 ** -12, 2.0 ** -40, 1.0], [1.0, 2.0 ** -12, -2.0 ** -40, 1.0]])
    b = torch.tensor([[1.0], [2.0 ** -12], [2.0 ** -40], [0.0]])
    got = matmul_rn(a, b)
    assert got[0, 0].item() == np.float32(1 + 2.0 ** -23) and got[1, 0].item() == 1.0
    assert torch.equal(got, matmul_rn_ref(a, b))


def test_matmul_rn_broadcasts_as_matmul():
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(1, 3, 4, 6, generator=g), torch.randn(2, 1, 6, 5, generator=g)
    assert matmul_rn(a, b).shape == torch.matmul(a, b).shape == (2, 3, 4, 5)
    assert torch.equal(matmul_rn(a, b), matmul_rn_ref(a, b))


def test_cumsum_tokens_sums_in_order_as_the_cpu_cumsum():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(2, 256, 24, generator=g) * torch.rand(2, 256, 24, generator=g) * 10
    assert torch.equal(cumsum_tokens(a), torch.cumsum(a, dim=1))
