import pytest
import torch

from harness.emulation.modules import ConvInput, EmuConv1d, EmuHadamard, EmuMambaBlock, UInput
from harness.kernels.hadamard import hadamard_matrix
from harness.kernels.rounding import round_half_away
from harness.spec import FloatOut, QTensor, QuantOut, Rounding


def test_online_hadamard_int8_matches_the_explicit_matrix():
    y = (torch.randn(2, 5, 48, generator=torch.Generator().manual_seed(0)) * 3).half().float()
    s_H = 0.021
    q = EmuHadamard(QuantOut(s_H, Rounding.HALF_AWAY))(y)
    t = (y.double() @ (hadamard_matrix(48) * 48 ** 0.5).t()).float()  # unnormalized sums, one rounding
    factor = torch.tensor((1 / 48 ** 0.5) / s_H, dtype=torch.float32)
    expected = round_half_away(t * factor).clamp(-128, 127).to(torch.int8)
    assert torch.equal(q.codes, expected) and q.scale == s_H
    f = EmuHadamard(FloatOut(torch.float32))(y)
    torch.testing.assert_close(f.double(), y.double() @ hadamard_matrix(48).t(), rtol=1e-6, atol=1e-7)


def test_online_hadamard_saturates():
    y = torch.full((1, 1, 12), 100.0)
    q = EmuHadamard(QuantOut(0.01, Rounding.HALF_AWAY))(y)
    assert set(q.codes.flatten().tolist()) == {127, -128} and q.n_clipped == 12


def test_dynamic_conv_input_scale():
    conv = EmuConv1d(QTensor(torch.ones(4, 4, dtype=torch.int8), 0.1), None, ConvInput("dynamic"), FloatOut(torch.float32))
    x = torch.tensor([[[0.5, -2.54, 1.0, 0.0]]])
    q = conv.quantize_input(x)
    amax = float(torch.tensor(2.54))  # the fp32 max of the tensor, as a Python float
    assert q.scale == float(torch.tensor(amax / 127.0, dtype=torch.float32))
    assert q.codes.tolist() == [[[25, -127, 50, 0]]]
    assert conv.quantize_input(torch.zeros(1, 1, 4)).scale == 1.0


def test_static_conv_input_keeps_matching_codes_and_quantizes_floats():
    conv = EmuConv1d(QTensor(torch.ones(2, 4, dtype=torch.int8), 0.1), None, ConvInput("static", 0.5), FloatOut(torch.float32))
    codes = QTensor(torch.tensor([[[3, -4]]], dtype=torch.int8), 0.5)
    assert conv.quantize_input(codes) is codes
    assert conv.quantize_input(torch.tensor([[[0.75, -1.25]]])).codes.tolist() == [[[2, -2]]]  # RNE of 1.5, -2.5


def test_grid_round_trip_must_be_lossless():
    block = EmuMambaBlock.__new__(EmuMambaBlock)
    torch.nn.Module.__init__(block)
    block.layer, block.u_input = 0, UInput("grid", 0.1, True)
    u = QTensor(torch.tensor([-128, 0, 127], dtype=torch.int8), 0.1)
    assert torch.equal(block._ssm_u(u).codes, u.codes)
    block.u_input = UInput("grid", 0.3, True)  # a different scale: the round trip changes codes
    with pytest.raises(RuntimeError, match="must be lossless"):
        block._ssm_u(u)


def test_online_hadamard_rounds_t_to_fp32_before_the_scale():
    """fht=False: t is rounded once to fp32, then multiplied by the fp32 scale (a mutant that kept t in float64
    survived: random inputs almost never sit on a tie). Here the scale is exactly 1.25 and t = 2 +- 2**-30,
    which rounds to 2.0 in fp32: both products are the tie 2.5 and round half away to 3; without the fp32
    rounding of t they are 2.5 +- 1e-9, giving 3 and 2."""
    import math

    import numpy as np
    from harness.emulation.modules import EmuHadamard
    from harness.spec import QuantOut, Rounding
    s_out = (1.0 / math.sqrt(2)) / 1.25
    assert np.float32((1.0 / math.sqrt(2)) / s_out) == 1.25   # the module's f32(1/sqrt(n) / s_H)
    y = torch.tensor([[[2.0, 2.0 ** -30]]], dtype=torch.float32)
    q = EmuHadamard(QuantOut(s_out, Rounding.HALF_AWAY))(y)
    assert q.codes.tolist() == [[[3, 3]]]


def test_a_lossy_grid_u_names_how_many_codes_moved():
    """ssm_u="grid" requantizes u at s_u and refuses when that is lossy, counting the codes that moved (a mutant
    that counted the unchanged ones survived: every pipeline passes the check)."""
    from types import SimpleNamespace
    conv_out = QTensor(torch.tensor([1, 2, 3, 4], dtype=torch.int8), 0.1)
    block = SimpleNamespace(u_input=UInput(ssm_u="grid", s_u=0.15, xproj_requant=False), layer=3)
    with pytest.raises(RuntimeError, match=r"^layer 3: dequantize -> requantize of u changed 3 codes \(must be lossless\)$"):
        EmuMambaBlock._ssm_u(block, conv_out)


def test_dynamic_conv_input_scale_is_amax_over_127_below_one_too():
    """qConvLayer.py:491-495: scale = x_absmax / 127 for any non-zero input, 1.0 only for an all-zero one (a
    mutant that used 1.0 up to amax 1 survived: the tests' activations were larger)."""
    module = EmuConv1d(torch.ones(2, 4), None, ConvInput("dynamic"), FloatOut(torch.float32))
    x = torch.tensor([[[0.5, -0.25], [0.125, 0.0]]])
    q = module.quantize_input(x)
    assert q.scale == float(torch.tensor(0.5 / 127.0, dtype=torch.float32)) and q.codes.tolist() == [[[127, -64], [32, 0]]]
    assert module.quantize_input(torch.zeros(1, 2, 2)).scale == 1.0


def test_linear_with_one_int8_operand_runs_in_floating_point():
    """Only int8 x int8 takes the W8A8 kernel; an int8 weight with a float input (a weight-only recipe) or an
    int8 input with a float weight is an fp32 matmul of the dequantized operands (a mutant that sent either
    case to the kernel survived: no built-in mode mixes them)."""
    from harness.emulation.modules import EmuLinear
    from harness.kernels.linear import Epilogue, float_linear
    g = torch.Generator().manual_seed(3)
    wq = QTensor(torch.randint(-128, 128, (5, 8), generator=g, dtype=torch.int8), 0.02)
    xq = QTensor(torch.randint(-128, 128, (2, 3, 8), generator=g, dtype=torch.int8), 0.05)
    x, w = xq.dequantize(), wq.dequantize()
    out = FloatOut(torch.float32)
    for weight, inp in ((wq, x), (w, xq)):
        got = EmuLinear(weight, Epilogue.RATIO_THEN_WEIGHT, out)(inp)
        assert isinstance(got, torch.Tensor) and torch.equal(got, float_linear(inp, weight, out))
