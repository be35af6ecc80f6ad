"""The kernel-order scan against a written-out loop of the kernel's own operation order, bit for bit.

quant_sscan_fwd_kernel.cuh:154-272 (notes §2.6 step 6), per (batch b, channel d, token t):

    delta = softplus(fma(s_dt, q_dt, bias[d]))       (int8 dt; a float dt: dt + bias)
    dA[n] = exp(delta * A[d, n]);  dBu[n] = B[t, n] * (delta * u)
    h[n]  = dA[n] * h[n] + dBu[n]                     (fp32 multiply, then fp32 add)
    y     = D[d] * u;  y = fma(h[n], C[t, n], y) for n = 0 .. d_state - 1
    out   = f16((y * z) / (1 + exp(-z)))

Every step is written with numpy float32 scalars (one IEEE rounding per operation);
an FMA is a float64 product plus add rounded once to float32 (the emulation's FMA),
exp and log1p are torch's on single fp32 values.
"""
import numpy as np
import pytest
import torch

from harness.ops.scan import ScanOrder, selective_scan
from harness.spec import FloatOut, QTensor

f32 = np.float32


def _exp(x):
    return f32(torch.exp(torch.tensor(x, dtype=torch.float32)).item())


def _log1p(x):
    return f32(torch.log1p(torch.tensor(x, dtype=torch.float32)).item())


def _fma(a, b, c):
    return f32(np.float64(a) * np.float64(b) + np.float64(c))


def kernel_loop(u, delta, A_log, B, C, D, z, bias, out_dtype):
    """Written-out kernel order; float operands are fp32 tensors, `delta` may be a QTensor."""
    batch, seqlen, d_inner = u.shape
    d_state = A_log.shape[1]
    A = (-torch.exp(A_log)).numpy()
    u, B, C, D, z, bias = (t.numpy() for t in (u, B, C, D, z, bias))
    y_out = np.zeros((batch, seqlen, d_inner), dtype=np.float32)
    h_out = np.zeros((batch, d_inner, d_state), dtype=np.float32)
    for b in range(batch):
        for d in range(d_inner):
            h = [f32(0.0)] * d_state
            for t in range(seqlen):
                if isinstance(delta, QTensor):
                    pre = _fma(f32(delta.scale), f32(delta.codes[b, t, d].item()), bias[d])
                else:
                    pre = f32(delta[b, t, d].item()) + bias[d]
                dt = _log1p(_exp(pre)) if pre <= 20.0 else pre
                uu = u[b, t, d]
                for n in range(d_state):
                    dA = _exp(dt * A[d, n])
                    dBu = B[b, t, n] * (dt * uu)
                    h[n] = dA * h[n] + dBu
                y = D[d] * uu
                for n in range(d_state):
                    y = _fma(h[n], C[b, t, n], y)
                zz = z[b, t, d]
                y_out[b, t, d] = (y * zz) / (f32(1.0) + _exp(-zz))
            h_out[b, d] = h
    y = torch.from_numpy(y_out).to(out_dtype).to(torch.float32)
    return y, torch.from_numpy(h_out)


def _operands(seed, batch=2, seqlen=7, d_inner=5, d_state=4, int8_dt=False):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(batch, seqlen, d_inner, generator=g)
    if int8_dt:
        delta = QTensor(torch.randint(-128, 128, (batch, seqlen, d_inner), generator=g, dtype=torch.int8), float(f32(0.0173)))
    else:
        delta = torch.randn(batch, seqlen, d_inner, generator=g) * 2.0 - 1.0
        delta[0, 0, 0] = 25.0  # above the softplus threshold
    A_log = torch.rand(d_inner, d_state, generator=g) * 2.0
    B = torch.randn(batch, seqlen, d_state, generator=g)
    C = torch.randn(batch, seqlen, d_state, generator=g)
    D = torch.rand(d_inner, generator=g) + 0.5
    z = torch.randn(batch, seqlen, d_inner, generator=g) * 3.0
    bias = torch.randn(d_inner, generator=g) * 0.5
    return u, delta, A_log, B, C, D, z, bias


@pytest.mark.parametrize("int8_dt", [False, True], ids=["float dt", "int8 dt (fma)"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_kernel_order_equals_the_written_out_loop_bit_for_bit(int8_dt, out_dtype):
    ops = _operands(0 if int8_dt else 1, int8_dt=int8_dt)
    y, h = selective_scan(*ops[:7], ops[7], ScanOrder.KERNEL, FloatOut(out_dtype))
    y_loop, h_loop = kernel_loop(*ops, out_dtype)
    assert torch.equal(h, h_loop)
    assert torch.equal(y, y_loop)


def test_the_loop_tells_the_orders_apart():
    """The loop is specific: the reference order differs from it somewhere (else this test proves nothing)."""
    ops = _operands(2)
    y_loop, _ = kernel_loop(*ops, torch.float32)
    y_ref, _ = selective_scan(*ops[:7], ops[7], ScanOrder.REFERENCE, FloatOut(torch.float32))
    assert not torch.equal(y_ref, y_loop)


def test_int8_dt_uses_one_fma():
    """An int8 dt enters as fma(s_dt, q, bias); dequantizing first (two roundings) must differ somewhere."""
    ops = _operands(3, seqlen=16, d_inner=16, int8_dt=True)
    y, _ = selective_scan(*ops[:7], ops[7], ScanOrder.KERNEL, FloatOut(torch.float32))
    deq = list(ops)
    deq[1] = ops[1].dequantize()
    y_two, _ = selective_scan(*deq[:7], deq[7], ScanOrder.KERNEL, FloatOut(torch.float32))
    assert not torch.equal(y, y_two)
