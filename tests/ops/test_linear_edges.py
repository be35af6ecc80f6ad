"""W8A8 linear details: the int32 GEMM and its float fallback, exact under every fp32 matmul precision and at
the block boundary; bad orders."""
import pytest
import torch

from harness.emulation.ops.linear import _EXACT_K, Epilogue, int8_gemm, int8_gemm_float, w8a8_linear
from harness.spec import FloatOut, QTensor, QuantOut, Rounding


@pytest.mark.parametrize("precision", ["highest", "high", "medium"])
def test_accumulation_is_exact_under_every_matmul_precision(precision):
    """With TF32/bf16 matmuls allowed, fp32 GEMMs are not exact: the fallback's float64 path must take over."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-128, 128, (3, 2100), generator=g, dtype=torch.int8)
    w = torch.randint(-128, 128, (5, 2100), generator=g, dtype=torch.int8)
    exact = (x.to(torch.int64) @ w.to(torch.int64).t()).to(torch.int32)
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision(precision)
        acc, fallback = int8_gemm(x, w), int8_gemm_float(x, w)
    finally:
        torch.set_float32_matmul_precision(old)
    assert acc.dtype == fallback.dtype == torch.int32 and torch.equal(acc, exact) and torch.equal(fallback, exact)


def test_block_size_keeps_partial_sums_exact():
    """_EXACT_K * 128 * 128 == 2**24: one more column per block and an all-extreme row would round."""
    assert _EXACT_K * 128 * 128 == 2 ** 24
    k = 1025
    x = torch.full((1, k), -128, dtype=torch.int8)
    w = torch.full((1, k), -128, dtype=torch.int8)
    x[0, -1], w[0, -1] = 127, 127   # the total 2**24 + 127 * 127 is odd: not representable in fp32
    assert int8_gemm_float(x, w).item() == int8_gemm(x, w).item() == 1024 * 128 * 128 + 127 * 127


@pytest.mark.parametrize("shape", [(1, 5, 3), (2, 3, 17, 9), (512, 1536, 80)])
def test_int32_gemm_and_its_fallback_equal_the_integer_product(shape, monkeypatch):
    """The int8 GEMM keeps x's leading dimensions; without torch._int_mm the float path gives the same int32."""
    g = torch.Generator().manual_seed(1)
    *lead, k, n = shape
    x = torch.randint(-128, 128, (*lead, k), generator=g, dtype=torch.int8)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    exact = (x.to(torch.int64) @ w.to(torch.int64).t()).to(torch.int32)
    fast = int8_gemm(x, w)

    def refuse(*_a):
        raise RuntimeError("no int8 GEMM on this device")
    monkeypatch.setattr(torch, "_int_mm", refuse)
    slow = int8_gemm(x, w)
    assert fast.shape == slow.shape == (*lead, n)
    assert torch.equal(fast, exact) and torch.equal(slow, exact) and slow.dtype == torch.int32


def test_unknown_epilogue_order_is_refused():
    x = QTensor(torch.ones(1, 2, dtype=torch.int8), 0.1)
    w = QTensor(torch.ones(3, 2, dtype=torch.int8), 0.1)
    with pytest.raises(ValueError, match="unknown epilogue order 'both'; valid: \\['ratio_then_weight', 'weight_then_ratio'\\]"):
        w8a8_linear(x, w, "both", FloatOut(torch.float32))


def test_int8_output_must_round_half_even():
    x = QTensor(torch.ones(1, 2, dtype=torch.int8), 0.1)
    w = QTensor(torch.ones(3, 2, dtype=torch.int8), 0.1)
    with pytest.raises(AssertionError, match="round half to even"):
        w8a8_linear(x, w, Epilogue.RATIO_THEN_WEIGHT, QuantOut(0.1, Rounding.HALF_AWAY))


def test_float_output_uses_ratio_s_x_and_the_output_dtype():
    x = QTensor(torch.tensor([[3, -1]], dtype=torch.int8), 0.5)
    w = QTensor(torch.tensor([[1, 1], [2, 0]], dtype=torch.int8), 0.25)
    y = w8a8_linear(x, w, Epilogue.WEIGHT_THEN_RATIO, FloatOut(torch.float32))
    assert y.tolist() == [[0.25, 0.75]]    # acc (2, 6) * 0.25 * 0.5
    y16 = w8a8_linear(QTensor(x.codes, 0.1), w, Epilogue.WEIGHT_THEN_RATIO, FloatOut(torch.float16))
    assert torch.equal(y16, y16.half().float()) and y16.dtype == torch.float32


def test_saturating_outputs_match_the_oracle():
    """Outputs beyond 127 saturate in the kernel and in the oracle (a clamp to 128 would wrap to -128)."""
    from harness.emulation.ops.linear import w8a8_linear_ref
    x = QTensor(torch.full((1, 4), 127, dtype=torch.int8), 0.5)
    w = QTensor(torch.tensor([[127, 127, 127, 127], [-128, -128, -128, -128], [1, 0, 0, 0]], dtype=torch.int8), 0.5)
    for order in Epilogue:
        got = w8a8_linear(x, w, order, QuantOut(0.25, Rounding.HALF_EVEN))
        ref = w8a8_linear_ref(x, w, order, QuantOut(0.25, Rounding.HALF_EVEN))
        assert got.codes.tolist() == ref.codes.tolist() == [[127, -128, 127]]


def test_float_fallback_blocks_the_last_dimension_of_any_input():
    """int8_gemm_float takes x (..., k) like int8_gemm: its blocks run over k, the last dimension (a mutant that
    took shape[1] survived: int8_gemm hands it 2-D inputs only, where the two are the same)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randint(-128, 128, (3, 1, 2100), generator=g, dtype=torch.int8)   # shape[1] = 1 < k = 2100
    w = torch.randint(-128, 128, (4, 2100), generator=g, dtype=torch.int8)
    exact = (x.to(torch.int64) @ w.to(torch.int64).t()).to(torch.int32)
    assert torch.equal(int8_gemm_float(x, w), exact)
