import pytest
import torch

import harness.kernels.scan as scan_mod
from harness.kernels.quant import dequantize
from harness.kernels.scan import ScanOrder, selective_scan, selective_scan_ref, softplus_thresholded
from harness.spec import FloatOut, QTensor


def _operands(seed=0, batch=2, seqlen=37, d_inner=32, d_state=8):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(batch, seqlen, d_inner, generator=g)
    delta = torch.randn(batch, seqlen, d_inner, generator=g) * 0.5 - 1.0
    A_log = torch.log(torch.arange(1, d_state + 1, dtype=torch.float32)).repeat(d_inner, 1)
    B = torch.randn(batch, seqlen, d_state, generator=g)
    C = torch.randn(batch, seqlen, d_state, generator=g)
    D = torch.rand(d_inner, generator=g) + 0.5
    z = torch.randn(batch, seqlen, d_inner, generator=g)
    bias = torch.randn(d_inner, generator=g) * 0.1
    return u, delta, A_log, B, C, D, z, bias


@pytest.mark.parametrize("order", list(ScanOrder))
def test_scan_matches_float64_oracle(order):
    ops = _operands()
    y, h = selective_scan(*ops[:7], delta_bias=ops[7], order=order, out=FloatOut(torch.float32))
    y_ref, h_ref = selective_scan_ref(*ops[:7], delta_bias=ops[7])
    # documented tolerance: fp32 arithmetic against an exact float64 oracle
    torch.testing.assert_close(y.double(), y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h.double(), h_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("order", list(ScanOrder))
def test_chunking_does_not_change_a_bit(order, monkeypatch):
    ops = _operands(1, seqlen=50)
    whole, h_whole = selective_scan(*ops[:7], delta_bias=ops[7], order=order, out=FloatOut(torch.float32))
    monkeypatch.setattr(scan_mod, "_CHUNK_ELEMENTS", 2 * 32 * 8 * 3)  # 3-step chunks
    chunked, h_chunked = selective_scan(*ops[:7], delta_bias=ops[7], order=order, out=FloatOut(torch.float32))
    assert torch.equal(whole, chunked) and torch.equal(h_whole, h_chunked)


def test_kernel_and_reference_orders_differ_only_by_rounding():
    ops = _operands(2, seqlen=64)
    a, _ = selective_scan(*ops[:7], delta_bias=ops[7], order=ScanOrder.KERNEL, out=FloatOut(torch.float32))
    b, _ = selective_scan(*ops[:7], delta_bias=ops[7], order=ScanOrder.REFERENCE, out=FloatOut(torch.float32))
    assert not torch.equal(a, b)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_fp16_output_is_rounded_once():
    ops = _operands(3)
    y32, _ = selective_scan(*ops[:7], delta_bias=ops[7], order=ScanOrder.REFERENCE, out=FloatOut(torch.float32))
    y16, _ = selective_scan(*ops[:7], delta_bias=ops[7], order=ScanOrder.REFERENCE, out=FloatOut(torch.float16))
    assert torch.equal(y16, y32.half().float())


def test_int8_operands_are_dequantized_with_their_scales():
    u, delta, A_log, B, C, D, z, bias = _operands(4)
    qu = QTensor(torch.clamp(torch.round(u / 0.03), -128, 127).to(torch.int8), 0.03)
    y_q, _ = selective_scan(qu, delta, A_log, B, C, D, z, delta_bias=bias, order=ScanOrder.REFERENCE, out=FloatOut(torch.float32))
    y_f, _ = selective_scan(dequantize(qu), delta, A_log, B, C, D, z, delta_bias=bias, order=ScanOrder.REFERENCE, out=FloatOut(torch.float32))
    assert torch.equal(y_q, y_f)


def test_softplus_threshold():
    x = torch.tensor([-30.0, 0.0, 20.0, 20.5, 50.0])
    out = softplus_thresholded(x)
    assert out[3].item() == 20.5 and out[4].item() == 50.0
    torch.testing.assert_close(out[:3], torch.log1p(torch.exp(x[:3])))
    torch.testing.assert_close(out, torch.nn.functional.softplus(x))


def test_the_oracle_itself_is_float64():
    """The oracle written out with Python floats (float64) on a tiny case, to 1e-15: it is the exact side of
    every tolerance above (a mutant that took exp(A_log) in fp32 survived them, 1e-7 off)."""
    import math
    u, delta, z = [[[0.7], [-0.3], [1.1]]], [[[0.2], [-0.4], [0.9]]], [[[0.5], [1.5], [-0.8]]]  # (1, 3, 1)
    A_log, D, bias = [[0.3, 1.7]], [0.6], [0.05]
    B, C = [[0.4, -1.2], [0.9, 0.3], [-0.6, 0.8]], [[1.0, 0.5], [-0.7, 0.2], [0.3, 0.9]]     # (3, 2) per token
    t = lambda x: torch.tensor(x, dtype=torch.float32)
    y, h = selective_scan_ref(t(u), t(delta), t(A_log), t([B]), t([C]), t(D), t(z), delta_bias=t(bias))
    f = lambda x: float(torch.tensor(x, dtype=torch.float32))   # the fp32 operands, exactly
    state, want = [0.0, 0.0], []
    for k in range(3):
        dt = math.log1p(math.exp(f(delta[0][k][0]) + f(bias[0])))
        for n in range(2):
            a = -math.exp(f(A_log[0][n]))
            state[n] = math.exp(dt * a) * state[n] + dt * f(B[k][n]) * f(u[0][k][0])
        out = sum(state[n] * f(C[k][n]) for n in range(2)) + f(D[0]) * f(u[0][k][0])
        zk = f(z[0][k][0])
        want.append(out * zk / (1 + math.exp(-zk)))
    assert y.dtype == h.dtype == torch.float64
    assert y.flatten().tolist() == pytest.approx(want, rel=1e-14, abs=0)
    assert h.flatten().tolist() == pytest.approx(state, rel=1e-14, abs=0)
