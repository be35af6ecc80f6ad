import pytest
import torch

from harness.kernels.quant import dequantize, fma_f32, minmax_scale_fp16, quantize, quantize_param_fp32, quantize_weight_fp16, saturate_int8, scale_from_amax_fp32
from harness.kernels.rounding import round_half_away, round_half_even
from harness.spec import QTensor, Rounding


def test_tie_rules_named():
    x = torch.tensor([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 2.4999, -3.5001], dtype=torch.float32)
    assert round_half_even(x).tolist() == [-2.0, -2.0, -0.0, 0.0, 2.0, 2.0, 2.0, -4.0]
    assert round_half_away(x).tolist() == [-3.0, -2.0, -1.0, 1.0, 2.0, 3.0, 2.0, -4.0]


def test_round_half_away_does_not_round_up_just_below_half():
    # in fp32, 0.49999997 + 0.5 rounds to 1.0; the float64 formulation must not
    x = torch.tensor([0.49999997, -0.49999997, 126.49999], dtype=torch.float32)
    assert round_half_away(x).tolist() == [0.0, -0.0, 126.0]


def test_saturate_counts_clipped():
    codes, n = saturate_int8(torch.tensor([-130.0, -128.0, 0.0, 127.0, 128.0, 300.0]))
    assert codes.dtype == torch.int8
    assert codes.tolist() == [-128, -128, 0, 127, 127, 127]
    assert n == 3


def test_quantize_divides_rounds_then_clamps():
    s = 0.5
    x = torch.tensor([0.25, 0.75, -0.25, 100.0, -100.0])  # /s = 0.5, 1.5, -0.5, 200, -200
    q_even = quantize(x, s, Rounding.HALF_EVEN)
    q_away = quantize(x, s, Rounding.HALF_AWAY)
    assert q_even.codes.tolist() == [0, 2, 0, 127, -128]
    assert q_away.codes.tolist() == [1, 2, -1, 127, -128]
    assert q_even.n_clipped == 2 and q_even.scale == s
    assert torch.equal(dequantize(q_even), torch.tensor([0.0, 1.0, 0.0, 63.5, -64.0]))


def test_weight_quantization_is_computed_in_fp16():
    w = torch.tensor([1.0, -0.6, 0.3337, 0.001], dtype=torch.float16)
    q = quantize_weight_fp16(w)
    s16 = torch.tensor(1.0, dtype=torch.float16) / 127  # fp16 division, as on the GPU
    assert q.scale == float(s16.float())
    expected = torch.round(w / s16).clamp(-128, 127).to(torch.int8)  # quotient rounded to fp16 first
    assert torch.equal(q.codes, expected)
    assert q.codes[0] == 127


def test_fp16_quotient_changes_a_code_where_fp32_would_not():
    # Find a weight whose quotient w / s rounds differently once it is stored in fp16 first.
    s16 = torch.tensor(1.0, dtype=torch.float16) / 127
    candidates = torch.arange(0.70, 0.80, 1e-4).to(torch.float16).unique()
    q16 = torch.round(candidates / s16)                   # Quamba: fp16 quotient, then RNE
    q32 = torch.round(candidates.float() / s16.float())   # a float32 quotient
    differing = candidates[q16 != q32]
    assert differing.numel() > 0
    w = torch.cat([torch.tensor([1.0], dtype=torch.float16), differing[:1]])
    q = quantize_weight_fp16(w)
    assert q.codes[1].item() == int(torch.round(differing[0] / s16).item())
    assert q.codes[1].item() != int(torch.round(differing[0].float() / s16.float()).item())


def test_param_quantization_fp32_no_clamp():
    w = torch.tensor([-3.0, 1.5, 0.0, 2.9999], dtype=torch.float32)
    q = quantize_param_fp32(w)
    s = torch.tensor(3.0) / 127
    assert q.scale == float(s)
    assert q.codes.tolist() == torch.round(w / s).to(torch.int8).tolist()
    assert q.codes.abs().max() == 127


def test_scale_rules():
    assert minmax_scale_fp16(torch.tensor(2.0, dtype=torch.float16)) == float((torch.tensor(2.0, dtype=torch.float16) / 127).float())
    # an all-zero tensor: max floored at 1e-5, 1e-5 / 127 < 1e-6, so the scale floor applies
    assert minmax_scale_fp16(torch.tensor(0.0, dtype=torch.float16)) == pytest.approx(1e-6)
    assert scale_from_amax_fp32(torch.tensor(0.0)) == pytest.approx(1e-6)
    assert scale_from_amax_fp32(torch.tensor(2.0)) == float(torch.tensor(2.0) / 127)


def test_fma_rounds_once():
    a = torch.tensor([1.0 + 2**-23], dtype=torch.float32)
    b = torch.tensor([1.0 - 2**-23], dtype=torch.float32)
    c = torch.tensor([-1.0], dtype=torch.float32)
    # exact a*b + c = -2**-46: a separate fp32 multiply rounds a*b to 1.0 and gives 0
    assert (a * b + c).item() == 0.0
    assert fma_f32(a, b, c).item() == -(2.0 ** -46)


def test_qtensor_requires_int8():
    with pytest.raises(AssertionError):
        QTensor(torch.zeros(3), 1.0)
