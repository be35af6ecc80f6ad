import pytest
import torch

from harness.kernels.linear import Epilogue, float_linear, int8_gemm, w8a8_linear, w8a8_linear_ref
from harness.spec import FloatOut, QTensor, QuantOut, Rounding


def _q(shape, seed, scale):
    g = torch.Generator().manual_seed(seed)
    return QTensor(torch.randint(-128, 128, shape, generator=g, dtype=torch.int8), scale)


@pytest.mark.parametrize("order", list(Epilogue))
@pytest.mark.parametrize("out", [QuantOut(0.0371, Rounding.HALF_EVEN), FloatOut(torch.float16), FloatOut(torch.float32)])
def test_w8a8_matches_integer_reference_bit_exactly(order, out):
    x = _q((2, 5, 96), 0, 0.0123)
    w = _q((40, 96), 1, 0.00071)
    got = w8a8_linear(x, w, order, out)
    ref = w8a8_linear_ref(x, w, order, out)
    if isinstance(out, QuantOut):
        assert torch.equal(got.codes, ref.codes) and got.scale == ref.scale
    else:  # both fp32 tensors holding out.dtype values (torch.equal would also pass an fp16 oracle: a
        # mutant of w8a8_linear_ref that dropped the fp32 cast survived)
        assert torch.equal(got, ref) and got.dtype == ref.dtype == torch.float32


def test_accumulation_is_exact_beyond_fp32_range():
    # K = 1536 extreme codes: |acc| = 1536 * 128 * 128 = 25165824 > 2**24 (not exact in fp32)
    k = 1536
    x = torch.full((1, k), -128, dtype=torch.int8)
    w = torch.full((1, k), -128, dtype=torch.int8)
    w[0, 0] = -127
    acc = int8_gemm(x, w)
    assert acc.item() == (k - 1) * 128 * 128 + 128 * 127


def test_epilogue_orders_are_the_documented_products():
    x = QTensor(torch.tensor([[3, -7]], dtype=torch.int8), 0.1)
    w = QTensor(torch.tensor([[5, 2]], dtype=torch.int8), 0.003)
    acc = torch.tensor(3 * 5 - 7 * 2, dtype=torch.float32)  # 1
    ratio = torch.tensor(0.1 / 0.02, dtype=torch.float32)
    s_w = torch.tensor(0.003, dtype=torch.float32)
    out = QuantOut(0.02, Rounding.HALF_EVEN)
    a = w8a8_linear(x, w, Epilogue.RATIO_THEN_WEIGHT, out)
    b = w8a8_linear(x, w, Epilogue.WEIGHT_THEN_RATIO, out)
    assert a.codes.item() == torch.round(s_w * (ratio * acc)).item()
    assert b.codes.item() == torch.round(ratio * (s_w * acc)).item()


def test_float_linear_dequantizes_operands():
    x = QTensor(torch.tensor([[2, -1]], dtype=torch.int8), 0.5)
    w = torch.tensor([[1.0, 4.0]])
    y = float_linear(x, w, FloatOut(torch.float32))
    assert y.item() == pytest.approx(2 * 0.5 * 1.0 - 0.5 * 4.0)
