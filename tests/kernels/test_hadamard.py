import pytest
import torch

from harness.kernels.hadamard import _base_matrix, hadamard_factors, hadamard_matrix, hadamard_transform

SYMMETRIC_SIZES = [1, 2, 16, 128, 12, 24, 192, 768, 1536]
OTHER_SIZES = [20, 28, 40, 56, 80, 160]


@pytest.mark.parametrize("n", SYMMETRIC_SIZES + OTHER_SIZES)
def test_orthogonal_and_fast_transform_equals_matrix(n):
    H = hadamard_matrix(n)
    torch.testing.assert_close(H @ H.t(), torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-12)
    x = torch.randn(3, n, dtype=torch.float64)
    torch.testing.assert_close(hadamard_transform(x), x @ H.t(), rtol=0, atol=1e-12)
    torch.testing.assert_close(hadamard_transform(x, transpose=True), x @ H, rtol=0, atol=1e-12)
    torch.testing.assert_close(hadamard_transform(hadamard_transform(x), transpose=True), x, rtol=0, atol=1e-12)


@pytest.mark.parametrize("n", SYMMETRIC_SIZES)
def test_involution_for_power_of_two_and_12_bases(n):
    H = hadamard_matrix(n)
    assert torch.equal(H, H.t())
    x = torch.randn(2, n, dtype=torch.float64)
    torch.testing.assert_close(hadamard_transform(hadamard_transform(x)), x, rtol=0, atol=1e-12)


@pytest.mark.parametrize("b", [12, 20, 28, 40])
def test_base_matrices_are_hadamard(b):
    H = _base_matrix(b)
    assert torch.equal(H @ H.t(), b * torch.eye(b, dtype=torch.float64))
    assert set(H.unique().tolist()) == {-1.0, 1.0}


def test_h12_rows_match_the_notes():
    # spec notes §2.2, rows r0 and r1
    H = _base_matrix(12)
    assert "".join("+" if v > 0 else "-" for v in H[0]) == "+-++++++++++"
    assert "".join("+" if v > 0 else "-" for v in H[1]) == "--+-+-+-+-+-"


def test_base_selection_follows_quamba():
    assert hadamard_factors(768) == (12, 64)
    assert hadamard_factors(1536) == (12, 128)
    assert hadamard_factors(80) == (40, 2)   # 40 is tried before 20, like get_had_fn
    assert hadamard_factors(20) == (20, 1)
    assert hadamard_factors(56) == (28, 2)
    assert hadamard_factors(256) == (1, 256)


@pytest.mark.parametrize("n", [36, 60, 100, 3, 0])
def test_unsupported_sizes_are_a_clear_error(n):
    with pytest.raises(ValueError, match=r"no Hadamard transform of size .* 12\*2\^k"):
        hadamard_factors(n)


def test_unnormalized_scale():
    x = torch.randn(4, 24, dtype=torch.float64)
    torch.testing.assert_close(hadamard_transform(x, normalized=False), hadamard_transform(x) * 24 ** 0.5)
