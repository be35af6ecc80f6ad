"""The field recipes' exact transforms (harness.kernels.field_transforms) on crafted inputs and against their refs."""
import pytest
import torch

from harness.kernels.field_transforms import (TransformError, covariance, klt, klt_ref, random_hadamard,
                                              random_hadamard_ref, smooth_factors, smooth_factors_ref)


def test_smooth_factors_written_out():
    # a = (4, 1, 0), column absmax w = (1, 4, 0 -> 1e-5): alpha 0.5 -> s = (2, 0.5, max(0 / ..., 1e-5))
    a = torch.tensor([4.0, 1.0, 0.0])
    w = torch.tensor([[1.0, -4.0, 0.0], [-0.5, 2.0, 0.0]])
    s = smooth_factors(a, w, 0.5)
    assert s.tolist() == pytest.approx([2.0, 0.5, 1e-5])
    assert smooth_factors(a, w, 0.5, floor=1e-2).tolist() == pytest.approx([2.0, 0.5, 1e-2])
    # alpha 0.75: a^0.75 / w^0.25 = (4^0.75 / 1, 1 / 4^0.25)
    assert smooth_factors(a, w, 0.75).tolist()[:2] == pytest.approx([4 ** 0.75, 4 ** -0.25])
    g = torch.Generator().manual_seed(0)
    a2, w2 = torch.rand(6, generator=g) * 5, torch.randn(4, 6, generator=g)
    assert torch.allclose(smooth_factors(a2, w2, 0.3), smooth_factors_ref(a2, w2, 0.3), rtol=1e-6)


@pytest.mark.parametrize("n", [8, 12, 24, 40])
def test_random_hadamard_is_orthogonal_seeded_and_signed(n):
    h = random_hadamard(n, 7)
    assert torch.allclose(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    assert torch.equal(h, random_hadamard(n, 7)) and torch.equal(h, random_hadamard_ref(n, 7))
    assert not torch.equal(h, random_hadamard(n, 8))
    assert torch.allclose(h.abs(), torch.full((n, n), n ** -0.5, dtype=torch.float64))


def test_klt_diagonalizes_the_covariance_with_fixed_signs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(200, 5, generator=g, dtype=torch.float64) @ torch.randn(5, 5, generator=g, dtype=torch.float64)
    cov = covariance(x)
    assert torch.allclose(cov, torch.cov(x.T))
    k = klt(cov)
    assert torch.allclose(k.T @ k, torch.eye(5, dtype=torch.float64), atol=1e-10)
    d = k.T @ cov @ k
    assert torch.allclose(d, torch.diag(torch.diagonal(d)), atol=1e-8)
    assert (torch.diagonal(d)[1:] >= torch.diagonal(d)[:-1]).all()  # eigenvalues ascending
    assert torch.equal(k, klt_ref(cov)) and torch.equal(klt(cov), klt(cov.clone()))
    assert (k[k.abs().argmax(0), torch.arange(5)] > 0).all()


def test_a_covariance_of_one_token_or_with_nan_is_an_error():
    with pytest.raises(TransformError, match="at least 2 tokens"):
        covariance(torch.randn(1, 4))
    bad = torch.eye(3, dtype=torch.float64)
    bad[0, 1] = float("nan")
    with pytest.raises(TransformError, match="not finite"):
        klt(bad)
