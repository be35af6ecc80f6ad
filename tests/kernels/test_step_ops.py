"""Decode-step ops against written-out loops of Quamba's kernels (kernels.step, kernels.state_update)."""
import numpy as np
import pytest
import torch

from harness.kernels.linear import Epilogue, w8a8_linear
from harness.kernels.quant import f32
from harness.kernels.scan import softplus_thresholded
from harness.kernels.state_update import (handover_codes, quant_state_update, quant_state_update_ref,
                                                requantize_state, triton_softplus)
from harness.kernels.step import (gemv_alpha, int8_conv_update, int8_conv_update_ref, shift_window,
                                        w8a8_gemv, w8a8_gemv_ref)
from harness.spec import FloatOut, QTensor, QuantOut, Rounding


def _codes(g, *shape, lo=-128, hi=128):
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(torch.int8)


@pytest.mark.parametrize("out", [QuantOut(0.0423, Rounding.HALF_EVEN), FloatOut(torch.float16)])
def test_gemv_is_the_kernels_one_alpha_epilogue(out):
    g = torch.Generator().manual_seed(1)
    x = QTensor(_codes(g, 1, 1, 48), 0.0173)
    w = QTensor(_codes(g, 40, 48), 0.00311)
    got, want = w8a8_gemv(x, w, out), w8a8_gemv_ref(x, w, out)
    if isinstance(out, QuantOut):
        assert torch.equal(got.codes, want.codes) and got.scale == want.scale
    else:
        assert torch.equal(got, want)


def test_gemv_alpha_is_rounded_as_quamba_computes_it():
    # qLinearLayer.py:587: (s_w * s_x / s_out) in fp32; 784: s_w * s_x
    s_x, s_w, s_out = 0.0173, 0.00311, 0.0423
    assert gemv_alpha(s_x, s_w, QuantOut(s_out, Rounding.HALF_EVEN)) == float(
        np.float32(np.float32(np.float32(s_w) * np.float32(s_x)) / np.float32(s_out)))
    assert gemv_alpha(s_x, s_w, FloatOut(torch.float16)) == float(np.float32(s_w) * np.float32(s_x))


def test_gemv_and_prefill_gemm_epilogues_differ_somewhere():
    """The one-alpha GEMV and the two-multiply prefill epilogue are different roundings: in fp32 (before
    the output's own rounding) they differ in the last bit of some values (else the GEMV op were redundant)."""
    g = torch.Generator().manual_seed(3)
    x = QTensor(_codes(g, 1, 64, 64), 0.0173)
    w = QTensor(_codes(g, 64, 64), 0.00311)
    out = FloatOut(torch.float32)
    gemv, gemm = w8a8_gemv(x, w, out), w8a8_linear(x, w, Epilogue.WEIGHT_THEN_RATIO, out)
    assert 0 < int((gemv != gemm).sum()) and torch.allclose(gemv, gemm, rtol=2e-7, atol=0)


@pytest.mark.parametrize("out", [QuantOut(0.0171, Rounding.HALF_AWAY), FloatOut(torch.float32)])
def test_int8_conv_update_is_the_kernels_fma_chain(out):
    g = torch.Generator().manual_seed(2)
    window = QTensor(_codes(g, 2, 24, 4), 0.059)
    weight = QTensor(_codes(g, 24, 4), 0.0042)
    bias = QTensor(_codes(g, 24), 0.0011)
    got, want = int8_conv_update(window, weight, bias, out), int8_conv_update_ref(window, weight, bias, out)
    if isinstance(out, QuantOut):
        assert torch.equal(got.codes, want.codes)
    else:
        assert torch.equal(got, want)


def test_window_shift_keeps_the_last_inputs_with_the_new_one_last():
    w = torch.arange(24, dtype=torch.int8).reshape(2, 3, 4)
    new = torch.tensor([[100, 101, 102], [103, 104, 105]], dtype=torch.int8)
    got = shift_window(w, new)
    assert torch.equal(got[..., :3], w[..., 1:]) and torch.equal(got[..., 3], new)


def _ssm_operands(g, d_inner=6, d_state=4, h_codes=None):
    h = QTensor(_codes(g, 1, d_inner, d_state) if h_codes is None else h_codes, 0.0031)
    return dict(h=h, u=QTensor(_codes(g, 1, d_inner), 0.0172), delta=QTensor(_codes(g, 1, d_inner), 0.0163),
                A_log=QTensor(_codes(g, d_inner, d_state, lo=0), 0.0201), B=QTensor(_codes(g, 1, d_state), 0.0412),
                C=QTensor(_codes(g, 1, d_state), 0.0412), D=QTensor(_codes(g, d_inner, lo=0), 0.0093),
                z=QTensor(_codes(g, 1, d_inner), 0.059), dt_bias=QTensor(_codes(g, d_inner), 0.0371))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_state_update_is_the_triton_kernel_written_out(dtype):
    """fp16: the kernel's output; fp32: y before that rounding, so the FMA choices are visible bit for bit."""
    ops = _ssm_operands(torch.Generator().manual_seed(4), d_inner=64, d_state=16)
    y, q, h = quant_state_update(**ops, out=FloatOut(dtype))
    y_ref, q_ref, h_ref = quant_state_update_ref(**ops, out=FloatOut(dtype))
    assert torch.equal(q.codes, q_ref.codes) and q.scale == ops["h"].scale
    assert torch.equal(h, h_ref) and torch.equal(y, y_ref)


def test_a_state_that_saturates_is_clamped_to_int8_and_counted():
    g = torch.Generator().manual_seed(5)
    ops = _ssm_operands(g, h_codes=torch.full((1, 6, 4), 127, dtype=torch.int8))
    ops["u"] = QTensor(torch.full((1, 6), 127, dtype=torch.int8), 0.5)     # dB * x far beyond 127 * s_h
    ops["B"] = QTensor(torch.full((1, 4), 100, dtype=torch.int8), 0.0412)
    y, q, h = quant_state_update(**ops, out=FloatOut(torch.float16))
    y_ref, q_ref, _ = quant_state_update_ref(**ops, out=FloatOut(torch.float16))
    assert torch.equal(q.codes, q_ref.codes) and torch.equal(y, y_ref)
    assert int(q.codes.max()) == 127 and q.n_clipped == int((h / 0.0031 > 127.5).sum()) > 0
    assert float(h.max()) > 127.5 * 0.0031   # y comes from the unclipped fp32 state (kernel line 121)


def test_step_requant_rounds_half_even_and_handover_half_away():
    s_h = 0.5                                  # 1.25 * 100 / (0.5 * 100) = 2.5 exactly: a tie
    h = torch.tensor([[[1.25, -1.25, 0.75]]])
    assert requantize_state(h, s_h).codes.tolist() == [[[2, -2, 2]]]     # rint: half to even
    assert handover_codes(h, s_h).codes.tolist() == [[[3, -3, 2]]]       # roundf: half away from zero


def test_triton_softplus_is_log_of_exp_plus_one_not_log1p():
    dt = torch.tensor([-20.0, -1.0, 0.0, 3.0, 20.0, 25.0])
    got = triton_softplus(dt)
    assert float(got[0]) == 0.0 and float(softplus_thresholded(dt)[0]) > 0.0   # 1 + 2e-9 rounds to 1
    assert torch.allclose(got[1:], softplus_thresholded(dt)[1:], rtol=1e-6) and float(got[-1]) == 25.0
