"""The kernel-order scan against a written-out loop of the kernel's own operation order, bit for bit.

quant_sscan_fwd_kernel.cuh:154-272 (spec notes §2.6 step 6), per (batch b, channel d, token t):

    delta = softplus(fma(s_dt, q_dt, bias[d]))       (int8 dt; a float dt: dt + bias)
    dA[n] = exp(delta * A[d, n]);  dBu[n] = B[t, n] * (delta * u)
    h[n]  = dA[n] * h[n] + dBu[n]                     (fp32 multiply, then fp32 add)
    y     = D[d] * u;  y = fma(h[n], C[t, n], y) for n = 0 .. d_state - 1
    out   = f16((y * z) / (1 + exp(-z)))

Every step is written with numpy float32 scalars (one IEEE rounding per operation);
an FMA is a float64 product plus add rounded once to float32 (the emulation's FMA),
exp, log1p and sigmoid are harness.kernels.portable's (elementwise, the same bits on every CPU).
"""
import numpy as np
import pytest
import torch

from harness.kernels import portable
from harness.kernels.scan import ScanOrder, selective_scan
from harness.spec import FloatOut, QTensor

f32 = np.float32


def _fma(a, b, c):
    return f32(np.float64(a) * np.float64(b) + np.float64(c))


# exp, log1p and sigmoid are portable's: elementwise functions whose bits depend on no CPU or layout.
def _softplus(pre):
    x = torch.from_numpy(pre)
    return torch.where(x <= 20.0, portable.log1p(portable.exp(x)), x).numpy()


def _dA(dt, A):
    """exp(delta * A) for every (t, b, n, d): the products in fp32, exp over the (seqlen, batch, d_state, d_inner) block."""
    seqlen, batch, d_inner, d_state = dt.shape[1], dt.shape[0], A.shape[0], A.shape[1]
    prod = np.zeros((seqlen, batch, d_state, d_inner), np.float32)
    for t in range(seqlen):
        for b in range(batch):
            for n in range(d_state):
                for d in range(d_inner):
                    prod[t, b, n, d] = dt[b, t, d] * A[d, n]
    return portable.exp(torch.from_numpy(prod)).numpy()


def kernel_loop(u, delta, A_log, B, C, D, z, bias, out_dtype):
    """Written-out kernel order; float operands are fp32 tensors, `delta` may be a QTensor."""
    batch, seqlen, d_inner = u.shape
    d_state = A_log.shape[1]
    A = (-portable.exp(A_log)).numpy()
    ez = portable.exp(-z).numpy()
    u, B, C, D, z, bias = (t.numpy() for t in (u, B, C, D, z, bias))
    pre = np.zeros((batch, seqlen, d_inner), np.float32)
    for b in range(batch):
        for t in range(seqlen):
            for d in range(d_inner):
                if isinstance(delta, QTensor):
                    pre[b, t, d] = _fma(f32(delta.scale), f32(delta.codes[b, t, d].item()), bias[d])
                else:
                    pre[b, t, d] = f32(delta[b, t, d].item()) + bias[d]
    dt = _softplus(pre)
    dA = _dA(dt, A)
    y_out = np.zeros((batch, seqlen, d_inner), dtype=np.float32)
    h_out = np.zeros((batch, d_inner, d_state), dtype=np.float32)
    for b in range(batch):
        for d in range(d_inner):
            h = [f32(0.0)] * d_state
            for t in range(seqlen):
                uu = u[b, t, d]
                for n in range(d_state):
                    dBu = B[b, t, n] * (dt[b, t, d] * uu)
                    h[n] = dA[t, b, n, d] * h[n] + dBu
                y = D[d] * uu
                for n in range(d_state):
                    y = _fma(h[n], C[b, t, n], y)
                y_out[b, t, d] = (y * z[b, t, d]) / (f32(1.0) + ez[b, t, d])
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
    y, h = selective_scan(*ops[:7], delta_bias=ops[7], order=ScanOrder.KERNEL, out=FloatOut(out_dtype))
    y_loop, h_loop = kernel_loop(*ops, out_dtype)
    assert torch.equal(h, h_loop)
    assert torch.equal(y, y_loop)


def test_the_loop_tells_the_orders_apart():
    """The loop is specific: the reference order differs from it somewhere (else this test proves nothing)."""
    ops = _operands(2)
    y_loop, _ = kernel_loop(*ops, torch.float32)
    y_ref, _ = selective_scan(*ops[:7], delta_bias=ops[7], order=ScanOrder.REFERENCE, out=FloatOut(torch.float32))
    assert not torch.equal(y_ref, y_loop)


def test_int8_dt_uses_one_fma():
    """An int8 dt enters as fma(s_dt, q, bias); dequantizing first (two roundings) must differ somewhere."""
    ops = _operands(3, seqlen=16, d_inner=16, int8_dt=True)
    y, _ = selective_scan(*ops[:7], delta_bias=ops[7], order=ScanOrder.KERNEL, out=FloatOut(torch.float32))
    deq = list(ops)
    deq[1] = ops[1].dequantize()
    y_two, _ = selective_scan(*deq[:7], delta_bias=deq[7], order=ScanOrder.KERNEL, out=FloatOut(torch.float32))
    assert not torch.equal(y, y_two)


def reference_gate(y, z, sig_z):
    """Today's reference gate y * (z * sigmoid(z)); issue 11 changes it to y * silu(z) (and the C.h sum to
    .sum(dim)): update this function and the C.h loop below with it."""
    return y * (z * sig_z)


def reference_loop(u, delta, A_log, B, C, D, z, bias, out_dtype):
    """The REFERENCE order written out: dBu = (delta * B) * u; y = sum_n h[n] * C[n] in order, + u * D;
    out = y * (z * sigmoid(z)); an int8 dt is dequantized first (codes * scale), then the bias added."""
    batch, seqlen, d_inner = u.shape
    d_state = A_log.shape[1]
    A = (-portable.exp(A_log)).numpy()
    dq = delta.dequantize().numpy() if isinstance(delta, QTensor) else delta.numpy()
    sig = portable.sigmoid(z).numpy()
    u, B, C, D, z, bias = (t.numpy() for t in (u, B, C, D, z, bias))
    dt = _softplus((dq + bias).astype(np.float32))
    dA = _dA(dt, A)
    y_out = np.zeros((batch, seqlen, d_inner), dtype=np.float32)
    for b in range(batch):
        for d in range(d_inner):
            h = [f32(0.0)] * d_state
            for t in range(seqlen):
                uu = u[b, t, d]
                for n in range(d_state):
                    h[n] = dA[t, b, n, d] * h[n] + (dt[b, t, d] * B[b, t, n]) * uu
                y = h[0] * C[b, t, 0]
                for n in range(1, d_state):
                    y = y + h[n] * C[b, t, n]
                y = y + uu * D[d]
                zz = z[b, t, d]
                y_out[b, t, d] = reference_gate(y, zz, sig[b, t, d])
    return torch.from_numpy(y_out).to(out_dtype).to(torch.float32)


@pytest.mark.parametrize("int8_dt", [False, True], ids=["float dt", "int8 dt"])
def test_reference_order_equals_its_written_out_loop(int8_dt):
    """Pins the reference order too (the scan of modes 1, 2-1..2-4 and 3), including the fp16 store."""
    ops = _operands(5 if int8_dt else 6, int8_dt=int8_dt)
    for out_dtype in (torch.float32, torch.float16):
        y, _ = selective_scan(*ops[:7], delta_bias=ops[7], order=ScanOrder.REFERENCE, out=FloatOut(out_dtype))
        assert torch.equal(y, reference_loop(*ops, out_dtype))
