"""Edges of kernels.quant that mutation testing showed unguarded (each docstring: the bug it catches)."""
import pytest
import torch

from harness.kernels.quant import quantize, quantize_param_fp32, quantize_weight_fp16, saturate_int8
from harness.kernels.rounding import round_half_away, round_with
from harness.spec import Rounding


def test_round_half_away_keeps_the_dtype():
    """A missing cast back would hand float64 to every caller (and double the memory of captures)."""
    for dtype in (torch.float32, torch.float16):
        assert round_half_away(torch.tensor([0.5, -1.5], dtype=dtype)).dtype == dtype


def test_unknown_rounding_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown rounding 'up'; valid: \['half_even', 'half_away'\]"):
        round_with(torch.zeros(1), "up")


@pytest.mark.parametrize("values, codes, clipped", [
    ([0.0, 200.0], [0, 127], 1),        # only the top is out of range
    ([-200.0, 0.0], [-128, 0], 1),      # only the bottom is out of range
    ([-128.0, 127.0], [-128, 127], 0),  # both bounds are in range
])
def test_saturation_when_only_one_side_is_out_of_range(values, codes, clipped):
    """An `or` for the `and` of the in-range check would wrap 200 to -56 instead of clipping it."""
    q, n = saturate_int8(torch.tensor(values))
    assert q.tolist() == codes and n == clipped


def test_nothing_clipped_counts_zero():
    """The fast path must report 0 clipped values (the stats' clipped_fraction)."""
    assert saturate_int8(torch.tensor([1.0, -3.0]))[1] == 0
    assert quantize(torch.tensor([0.1, -0.2]), 0.01, Rounding.HALF_EVEN).n_clipped == 0


def test_quantize_divides_in_fp32_whatever_the_input_dtype():
    """fp16 input divided by an fp32 0-d scale stays fp16 in torch: without the fp32 cast the quotient
    would round to fp16 first. Find an fp16 value where the fp16 quotient rounds to another code."""
    s = 0.0123
    x16 = torch.arange(1.0, 1.6, 2 ** -10, dtype=torch.float16)
    fp16_quotient = torch.round(x16 / torch.tensor(s, dtype=torch.float32))
    fp32_quotient = torch.round(x16.float() / torch.tensor(s, dtype=torch.float32))
    assert not torch.equal(fp16_quotient, fp32_quotient)
    got = quantize(x16, s, Rounding.HALF_EVEN).codes
    assert torch.equal(got, quantize(x16.float(), s, Rounding.HALF_EVEN).codes)
    assert torch.equal(got.float(), fp32_quotient.clamp(-128, 127))


def test_weight_quantization_is_fp16_also_for_fp32_holding_fp16_values():
    """Prepared weights are fp32 tensors holding fp16 values; the scale and quotient must still be fp16."""
    w16 = (torch.randn(64, 48, generator=torch.Generator().manual_seed(0)) * 0.05).half()
    a, b = quantize_weight_fp16(w16), quantize_weight_fp16(w16.float())
    assert a.scale == b.scale and torch.equal(a.codes, b.codes)
    s32 = w16.float().abs().max() / 127
    assert b.scale == float((w16.abs().max() / 127).float()) and b.scale != float(s32)
    assert b.n_clipped == 0 and a.n_clipped == 0


def test_param_quantization_is_fp32_also_for_fp16_input():
    w = (torch.randn(33, generator=torch.Generator().manual_seed(1)) * 3).half()
    a, b = quantize_param_fp32(w), quantize_param_fp32(w.float())
    assert a.scale == b.scale and torch.equal(a.codes, b.codes)
    assert a.scale != float((w.abs().max() / 127).float())   # not the fp16 scale
    assert a.n_clipped == 0


def test_unknown_output_spec_is_named():
    from harness.kernels.quant import to_output
    with pytest.raises(TypeError, match="unknown output spec 'int4'"):
        to_output(torch.zeros(1), "int4")


def test_fma_with_python_float_operands_rounds_once():
    """A scale passed as a Python float (as the scan and conv do) must not make the product an fp32 multiply."""
    from harness.kernels.quant import fma_f32
    a = 1.0 + 2 ** -23
    b = torch.tensor([1.0 - 2 ** -23], dtype=torch.float32)
    out = fma_f32(a, b, torch.tensor([-1.0]))
    assert out.dtype == torch.float32 and out.item() == -(2.0 ** -46)
    assert fma_f32(a, b, -1.0).item() == -(2.0 ** -46)        # c as a Python float too


def test_scale_rules_compute_in_their_own_dtype_whatever_the_input():
    """min-max scales are fp16 quotients, percentile scales fp32 quotients, also for an input of the other dtype."""
    from harness.kernels.quant import minmax_scale_fp16, scale_from_amax_fp32
    amax = torch.tensor(0.8437, dtype=torch.float16)
    s16 = float((amax / 127).float())
    s32 = float(amax.float() / 127)
    assert s16 != s32
    assert minmax_scale_fp16(amax) == s16 and minmax_scale_fp16(amax.float()) == s16
    assert scale_from_amax_fp32(amax.float()) == s32 and scale_from_amax_fp32(amax) == s32


def test_dequantize_returns_a_float_tensor_itself():
    """Only QTensors are dequantized; torch's own Tensor.dequantize() would turn an fp16 tensor into fp32."""
    from harness.kernels.quant import dequantize
    x = torch.tensor([1.5], dtype=torch.float16)
    assert dequantize(x) is x
