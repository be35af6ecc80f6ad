"""The int8 conv against a written-out loop of the kernel's operation order, bit for bit.

quant_causal_conv1d_fwd_kernel.cuh:80-151 (spec notes §2.6 step 3), per (b, d, t):
    acc = sum_k Wq[d, k] * xq[t - (K - 1) + k]        exact integer, zero history
    v   = fma(f32(s_w * s_x), acc, f32(bq[d]) * s_b)  one rounding (f32(bq) * s_b is an fp32 product)
    out = v / (1 + exp(-v))                            fp32 (exp: torch's, over the whole tensor)
A tolerance test against a float64 oracle cannot see a dropped FMA or an unrounded s_w * s_x; this can.
"""
import numpy as np
import pytest
import torch

from harness.kernels import portable
from harness.kernels.conv1d import int8_causal_conv1d_silu
from harness.kernels.quant import f32 as f32_of
from harness.spec import FloatOut, QTensor, QuantOut, Rounding

f32 = np.float32


def conv_loop(x: QTensor, w: QTensor, b: QTensor | None) -> torch.Tensor:
    batch, seqlen, d_inner = x.codes.shape
    K = w.codes.shape[1]
    xs, ws = x.codes.numpy().astype(np.int64), w.codes.numpy().astype(np.int64)
    scale_wx = f32(f32_of(w.scale * x.scale))
    out = np.zeros((batch, seqlen, d_inner), np.float32)
    for bb in range(batch):
        for d in range(d_inner):
            bias = f32(0.0) if b is None else f32(b.codes[d].item()) * f32(b.scale)
            for t in range(seqlen):
                acc = sum(ws[d, k] * xs[bb, t - (K - 1) + k, d] for k in range(K) if t - (K - 1) + k >= 0)
                out[bb, t, d] = f32(np.float64(scale_wx) * np.float64(acc) + np.float64(bias))
    ev = portable.exp(-torch.from_numpy(out)).numpy()  # elementwise, the same bits on every CPU
    return torch.from_numpy(out / (f32(1.0) + ev))


def _inputs(seed, batch=2, seqlen=9, d=6, k=4):
    g = torch.Generator().manual_seed(seed)
    x = QTensor(torch.randint(-128, 128, (batch, seqlen, d), generator=g, dtype=torch.int8), f32_of(0.0213))
    w = QTensor(torch.randint(-127, 128, (d, k), generator=g, dtype=torch.int8), f32_of(0.00437))
    b = QTensor(torch.randint(-127, 128, (d,), generator=g, dtype=torch.int8), f32_of(0.00113))
    return x, w, b


@pytest.mark.parametrize("with_bias", [True, False])
def test_int8_conv_equals_the_written_out_loop(with_bias):
    x, w, b = _inputs(0)
    b = b if with_bias else None
    got = int8_causal_conv1d_silu(x, w, b, FloatOut(torch.float32))
    assert torch.equal(got, conv_loop(x, w, b))


def test_the_quantized_output_uses_the_same_value():
    x, w, b = _inputs(1)
    v = conv_loop(x, w, b)
    q = int8_causal_conv1d_silu(x, w, b, QuantOut(0.0117, Rounding.HALF_AWAY))
    expected = torch.sign(v / torch.tensor(0.0117)) * torch.floor((v / torch.tensor(0.0117)).double().abs() + 0.5)
    assert torch.equal(q.codes, expected.clamp(-128, 127).to(torch.int8))


def test_the_loop_sees_a_dropped_fma():
    """Multiply then add with two roundings differs from the FMA somewhere (else the test above is blind)."""
    x, w, b = _inputs(2, seqlen=32, d=32)
    scale_wx = torch.tensor(f32_of(w.scale * x.scale))
    xs, ws = x.codes.to(torch.float32), w.codes.to(torch.float32)
    accs = sum(ws[:, k] * torch.nn.functional.pad(xs, (0, 0, 3 - k, 0))[:, :32] for k in range(4))
    bias = b.codes.to(torch.float32) * torch.tensor(b.scale)
    two = scale_wx * accs + bias
    one = (scale_wx.double() * accs.double() + bias.double()).float()
    assert not torch.equal(two, one)
