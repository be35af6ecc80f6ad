"""Quamba2 W8A8 ops against written-out references of Quamba's arithmetic (enyac-group/Quamba c474646):
the int8 in_proj with its per-column output factor and the grouped int8 conv1d."""
from __future__ import annotations

import numpy as np
import torch

from harness.kernels.conv1d import silu_kernel
from harness.kernels.conv1d_grouped import conv_out_scales, q2_conv1d, q2_conv1d_ref, x_channel_scales
from harness.kernels.linear import q2_in_proj, q2_in_proj_ref
from harness.kernels.quant import fma_f32
from harness.spec import QTensor


def _codes(gen, *shape):
    return torch.randint(-128, 128, shape, generator=gen, dtype=torch.int64).to(torch.int8)


def test_in_proj_equals_reference_and_rounds_half_even():
    gen = torch.Generator().manual_seed(0)
    x = QTensor(_codes(gen, 2, 5, 24), 0.013)
    w = _codes(gen, 19, 24)
    # five splits (z | x | B | C | dt) with their own f32(s_w / s_out) per column
    b = torch.tensor(sum(([s] * n for s, n in ((0.1, 6), (0.2, 6), (0.05, 2), (0.07, 2), (0.3, 3))), []),
                     dtype=torch.float32)
    got = q2_in_proj(x, w, b)
    assert got.dtype == torch.int8 and torch.equal(got, q2_in_proj_ref(x, w, b))
    assert ((got == 127) | (got == -128)).any() and (got.abs() < 100).any()  # saturated and in-range codes
    # a tie: a * b * acc = 1 * 0.5 * 5 = 2.5 -> 2 (half to even, cvt.rni), not 3
    one = QTensor(torch.tensor([[5]], dtype=torch.int8), 1.0)
    tie = q2_in_proj(one, torch.tensor([[1], [-1]], dtype=torch.int8), torch.tensor([0.5, 0.5]))
    assert tie.tolist() == [[2, -2]] and torch.equal(tie, q2_in_proj_ref(one, torch.tensor([[1], [-1]], dtype=torch.int8),
                                                                          torch.tensor([0.5, 0.5])))


def _grouping():
    """2 SSD groups of 2 heads x 4 dims (x_dim 16); head groups {0}, {1} and dim groups of uneven sizes."""
    head_range = torch.tensor([[1, 2], [2, 2]], dtype=torch.int32)      # group 1: both heads in head group 0
    dim_range = torch.tensor([[[1, 4], [3, 4]], [[2, 4], [4, 4]]], dtype=torch.int32)
    scales = torch.tensor([[[0.01, 0.02], [0.03, 0.04]], [[0.05, 0.06], [0.07, 0.08]]], dtype=torch.float32)
    return scales, head_range, dim_range


def test_x_channel_scales_follow_the_kernels_lookup():
    scales, head_range, dim_range = _grouping()
    got = x_channel_scales(scales, head_range, dim_range, x_dim=16, headdim=4)
    # group 0: head 0 (dims 0 | 1-3), head 1 (dims 0-2 | 3); group 1: heads 0 and 1 in head group 0 (dims 0-1 | 2-3)
    want = [0.01, 0.02, 0.02, 0.02, 0.03, 0.03, 0.03, 0.04, 0.05, 0.05, 0.06, 0.06, 0.05, 0.05, 0.06, 0.06]
    assert torch.equal(got, torch.tensor(want, dtype=torch.float32))
    all_ = conv_out_scales(got, torch.tensor([0.1, 0.2]), torch.tensor([0.3, 0.4]), d_state=3)
    assert all_[16:].tolist() == [float(np.float32(v)) for v in [0.1] * 3 + [0.2] * 3 + [0.3] * 3 + [0.4] * 3]


def test_conv1d_equals_reference():
    gen = torch.Generator().manual_seed(1)
    scales, head_range, dim_range = _grouping()
    out = conv_out_scales(x_channel_scales(scales, head_range, dim_range, 16, 4), torch.tensor([0.1, 0.2]),
                          torch.tensor([0.3, 0.4]), 3)
    xBC, weight, bias = _codes(gen, 2, 7, 28), _codes(gen, 28, 4), _codes(gen, 28)
    args = ((0.02, 0.03, 0.05), weight, (0.004, 0.006, 0.008), bias, (0.01, 0.02, 0.03), out)
    got = q2_conv1d(xBC, *args, x_dim=16)
    assert got.dtype == torch.int8 and torch.equal(got, q2_conv1d_ref(xBC, *args, x_dim=16))
    assert torch.equal(q2_conv1d(xBC, args[0], weight, args[2], None, args[4], out, x_dim=16),
                       q2_conv1d_ref(xBC, args[0], weight, args[2], None, args[4], out, x_dim=16))
    # causal: the first token sees only itself (tap 3), so changing later tokens changes nothing before them
    later = xBC.clone()
    later[:, 4:] = 0
    assert torch.equal(q2_conv1d(later, *args, x_dim=16)[:, :4], got[:, :4])


def test_conv1d_rounds_half_away_from_zero():
    """roundf: find a bias whose SiLU output v gives v / s_out = k + 0.5 exactly, and check the code is k + 1."""
    one = torch.ones(1, 1, 3, dtype=torch.int8)
    weight = torch.zeros(3, 4, dtype=torch.int8)
    for code in range(1, 128):
        bias = torch.tensor([code, 0, 0], dtype=torch.int8)
        v = silu_kernel(fma_f32(torch.tensor([1e-4]), torch.zeros(1), torch.tensor([np.float32(0.05) * np.float32(code)])))
        s_out = torch.tensor(v.item() / 2.5, dtype=torch.float32)
        if (v / s_out).item() == 2.5:
            scales = torch.tensor([s_out.item(), 1.0, 1.0])
            got = q2_conv1d(one, (1.0, 1.0, 1.0), weight, (1e-4, 1.0, 1.0), bias, (0.05, 1.0, 1.0), scales, x_dim=1)
            assert got[0, 0, 0].item() == 3 and torch.equal(got, q2_conv1d_ref(one, (1.0, 1.0, 1.0), weight, (1e-4, 1.0, 1.0),
                                                                                 bias, (0.05, 1.0, 1.0), scales, x_dim=1))
            return
    raise AssertionError("no exact tie found")


def test_in_proj_epilogue_order_is_b_then_a():
    """Compute0 = b * acc, then a * Compute0 (quant_linear_fwd_kernel.cuh:91-100): scanning a over consecutive
    fp32 values around a tie (a * b * acc = 100.5) finds an `a` where (a * b) * acc rounds to another code;
    the op gives the b-then-a code."""
    x_codes = torch.tensor([[97, -61, 120]], dtype=torch.int8)
    w_codes = torch.tensor([[101, -77, 54]], dtype=torch.int8)
    acc = np.float32(int((x_codes.to(torch.int64) * w_codes.to(torch.int64)).sum()))  # 97*101 + 61*77 + 120*54
    found = None
    for b in np.linspace(0.011, 0.09, 200).astype(np.float32):
        a = np.float32(100.5 / float(np.float32(b * acc)))
        for _ in range(40):
            a = np.nextafter(a, np.float32(0))
        for _ in range(80):
            if np.rint(a * np.float32(b * acc)) != np.rint(np.float32(a * b) * acc):
                found = (a, b)
                break
            a = np.nextafter(a, np.float32(1))
        if found:
            break
    assert found is not None
    a, b = found
    got = q2_in_proj(QTensor(x_codes, float(a)), w_codes, torch.tensor([float(b)]))
    assert got.item() == int(np.rint(a * np.float32(b * acc))) != int(np.rint(np.float32(a * b) * acc))


def test_split_weights_are_quantized_per_split():
    """Each split at its own absmax scale (quant_utils.py:16-27, in fp16), b = f32(s_w / s_out) per column."""
    from harness.recipes.quamba.q2.weights import q2_conv_weights, q2_in_proj_weight

    w = torch.tensor([[0.5, -1.0], [0.25, 0.125], [8.0, -2.0], [0.0, 1.0], [0.03, 0.01]]).to(torch.float16).float()
    codes, b, scales = q2_in_proj_weight(w, [2, 2, 1], [0.1, 0.5, 0.02])
    s = [float(np.float16(1.0) / np.float16(127)), float(np.float16(8.0) / np.float16(127)),
         float(np.float16(0.03) / np.float16(127))]
    assert scales == s
    assert codes[0].tolist() == [64, -127] and codes[2].tolist() == [127, -32] and codes[4, 0].item() == 127
    assert b.tolist() == [float(np.float32(s[0] / 0.1))] * 2 + [float(np.float32(s[1] / 0.5))] * 2 + \
        [float(np.float32(s[2] / 0.02))]
    wc, ws, bcodes, bs = q2_conv_weights(torch.tensor([[1.0], [0.5], [4.0], [2.0]]), torch.tensor([0.1, 0.2, 3.0, 6.0]),
                                         x_dim=2, bc=1)
    assert wc[:, 0].tolist() == [127, 64, 127, 127] and bcodes.tolist() == [64, 127, 127, 127]
    assert ws[1] == float(np.float32(4.0) / np.float32(127)) and bs[2] == float(np.float32(6.0) / np.float32(127))


def test_conv_weights_are_quantized_in_fp32():
    """Quamb2Conv1D casts weight and bias to fp32 before the absmax (qConvLayer.py:240, :256): fp32 scale and
    division. 0.603515625 at absmax f16(0.7) is code 109 in fp32 (109.46) but 110 in fp16."""
    from harness.recipes.quamba.q2.weights import q2_conv_weights

    w = torch.tensor([[0.7], [0.603515625], [1.0], [1.0]]).to(torch.float16).float()
    wc, ws, bcodes, bs = q2_conv_weights(w, w[:, 0].clone(), x_dim=2, bc=1)
    s = np.float32(np.float32(np.float16(0.7)) / np.float32(127))
    assert ws[0] == float(s) and bs[0] == float(s)
    want = int(np.rint(np.float32(np.float32(0.603515625) / s)))
    assert want == 109 and wc[1, 0].item() == want and bcodes[1].item() == want


def test_gated_norm_is_groupwise_and_close_to_its_float64_reference():
    from harness.kernels.norms import q2_gated_norm, q2_gated_norm_ref

    gen = torch.Generator().manual_seed(3)
    y = (torch.randn(2, 9, 24, generator=gen) * 3).to(torch.float16).float()
    z = _codes(gen, 2, 9, 24)
    w = (1 + 0.3 * torch.randn(24, generator=gen)).to(torch.float16).float()
    got = q2_gated_norm(y, z, 0.04, w, 3, 1e-5)
    ref = q2_gated_norm_ref(y, z, 0.04, w, 3, 1e-5)
    assert torch.equal(got, got.to(torch.float16).float())  # fp16 output
    ulp = torch.abs(ref) * 2.0 ** -10 + 2.0 ** -24
    assert bool((torch.abs(got - ref) <= ulp).all()) and (got == ref).float().mean() > 0.95
    assert not torch.allclose(got, q2_gated_norm_ref(y, z, 0.04, w, 1, 1e-5), rtol=1e-2)  # per group, not whole


def test_q2_ssd_dequantizes_as_the_kernels_and_scans():
    from harness.kernels.ssd_inputs import Q2SSDParams, q2_ssd, q2_ssd_inputs
    from mamba2_fixtures import ssd_float64 as _ssd_float64

    gen = torch.Generator().manual_seed(4)
    h, hd, g, n = 4, 3, 2, 5
    p = Q2SSDParams(A_log=QTensor(_codes(gen, h), 0.01), D=QTensor(_codes(gen, h), 0.02),
                    dt_bias=torch.tensor([0.5, -1.0, 0.25, 2.0]).to(torch.float16).float(), dt_scale=0.05, chunk_size=4)
    q_x, q_dt = _codes(gen, 1, 11, h, hd), _codes(gen, 1, 11, h)
    q_B, q_C = _codes(gen, 1, 11, g, n), _codes(gen, 1, 11, g, n)
    x_scales = torch.rand(h * hd, generator=gen) * 0.02 + 0.001
    kw = dict(q_B=q_B, B_scales=torch.tensor([0.01, 0.03]), q_C=q_C, C_scales=torch.tensor([0.02, 0.04]))
    v = q2_ssd_inputs(p, q_x, x_scales, q_dt, **kw)
    # by hand: dt = softplus(f32(0.05 * q) + f16 bias), A_log = f32(0.01 * q), x per channel, B per SSD group
    k = (0, 3, 1)
    want_dt = np.log1p(np.exp(np.float64(np.float32(np.float32(0.05) * np.float32(int(q_dt[k]))) - 1.0)))  # head 1: bias -1
    assert abs(float(v["dt"][k]) - want_dt) <= 1e-6 * max(1.0, want_dt)
    assert float(v["A_log"][2]) == float(np.float32(np.float32(0.01) * np.float32(int(p.A_log.codes[2]))))
    assert float(v["x"][0, 5, 2, 1]) == float(np.float32(x_scales[2 * hd + 1]) * np.float32(int(q_x[0, 5, 2, 1])))
    assert float(v["B"][0, 7, 1, 4]) == float(np.float32(0.03) * np.float32(int(q_B[0, 7, 1, 4])))
    y, state = q2_ssd(p, q_x, x_scales, q_dt, **kw)
    y64, s64 = _ssd_float64(v["x"], v["dt"], v["A_log"], v["B"], v["C"], v["D"])
    assert float((y.double() - y64).norm() / y64.norm()) < 1e-6 and float((state.double() - s64).norm() / s64.norm()) < 1e-6
