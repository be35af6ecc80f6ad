import torch

from harness.kernels.conv1d import causal_conv1d_silu_ref, float_causal_conv1d_silu, int8_causal_conv1d_silu
from harness.kernels.quant import quantize
from harness.spec import FloatOut, QTensor, QuantOut, Rounding


def _inputs(seed=0, batch=2, seqlen=11, d=16, k=4):
    g = torch.Generator().manual_seed(seed)
    x = QTensor(torch.randint(-128, 128, (batch, seqlen, d), generator=g, dtype=torch.int8), 0.021)
    w = QTensor(torch.randint(-127, 128, (d, k), generator=g, dtype=torch.int8), 0.0043)
    b = QTensor(torch.randint(-127, 128, (d,), generator=g, dtype=torch.int8), 0.0011)
    return x, w, b


def test_int8_conv_value_matches_reference_conv():
    x, w, b = _inputs()
    v = int8_causal_conv1d_silu(x, w, b, FloatOut(torch.float32))
    ref = causal_conv1d_silu_ref(x.dequantize(), w.dequantize(), b.dequantize())
    torch.testing.assert_close(v.double(), ref, rtol=1e-5, atol=1e-6)


def test_int8_output_is_the_half_away_quantization_of_the_same_value():
    x, w, b = _inputs(1)
    v = int8_causal_conv1d_silu(x, w, b, FloatOut(torch.float32))
    q = int8_causal_conv1d_silu(x, w, b, QuantOut(0.013, Rounding.HALF_AWAY))
    assert torch.equal(q.codes, quantize(v, 0.013, Rounding.HALF_AWAY).codes)


def test_conv_is_causal():
    x, w, b = _inputs(2)
    y1 = int8_causal_conv1d_silu(x, w, b, FloatOut(torch.float32))
    changed = x.codes.clone()
    changed[:, 7:] = 0
    y2 = int8_causal_conv1d_silu(QTensor(changed, x.scale), w, b, FloatOut(torch.float32))
    assert torch.equal(y1[:, :7], y2[:, :7])
    assert not torch.equal(y1[:, 7:], y2[:, 7:])


def test_float_conv_matches_reference():
    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(2, 9, 8, generator=g), torch.randn(8, 4, generator=g), torch.randn(8, generator=g)
    y = float_causal_conv1d_silu(x, w, b, FloatOut(torch.float32))
    torch.testing.assert_close(y.double(), causal_conv1d_silu_ref(x, w, b), rtol=1e-5, atol=1e-6)
