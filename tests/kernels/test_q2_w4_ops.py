"""Quamba2's int4 linears (kernels.w4_linear) against their written-out references."""
from __future__ import annotations

import torch

from harness.kernels.int4 import Int4Weight
from harness.kernels.w4_linear import (qqq_int8_weight, qqq_int8_weight_ref, w4a8_linear, w4a8_linear_ref,
                                         w4a16_linear, w4a16_linear_ref)
from harness.spec import QTensor


def _weight(out: int, inp: int, group: int, channel: bool, seed: int = 0) -> Int4Weight:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (out, inp), generator=g).to(torch.uint8)
    gs = (torch.rand(out, inp // group, generator=g) * 0.05 + 0.001).to(torch.float16)
    if channel:
        gs = (torch.rand(out, inp // group, generator=g) * 15 + 0.5).to(torch.float16)
    ch = (torch.rand(out, generator=g) * 0.01 + 1e-4) if channel else None
    return Int4Weight(codes, gs, ch, group)


def test_w4a16_matches_its_reference():
    w = _weight(6, 256, 128, False)
    x = (torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(1))).to(torch.float16).to(torch.float32)
    y = w4a16_linear(x, w)
    assert y.shape == (2, 3, 6)
    assert torch.equal(y, w4a16_linear_ref(x, w))
    assert torch.equal(y, y.to(torch.float16).to(torch.float32))


def test_w4a16_rounds_the_dequantized_weight_to_fp16():
    # (code - 8) * s with s = 0.1 (fp16 0.0999755859375): 7 * s must be rounded to fp16 before the dot product
    w = Int4Weight(torch.tensor([[15, 8]], dtype=torch.uint8), torch.tensor([[0.1]], dtype=torch.float16), None, 2)
    x = torch.tensor([[1.0, 0.0]])
    s = float(torch.tensor(0.1, dtype=torch.float16))
    expect = float(torch.tensor(7 * s).to(torch.float16))
    assert w4a16_linear(x, w).item() == expect == w4a16_linear_ref(x, w).item()


def test_qqq_int8_weight_matches_the_fp16_bit_trick():
    w = _weight(5, 256, 128, True)
    w8 = qqq_int8_weight(w)
    assert torch.equal(w8, qqq_int8_weight_ref(w))
    exact = torch.round((w.codes.to(torch.float32) - 8) * w.group_scales.to(torch.float32).repeat_interleave(128, 1))
    inside = exact.abs() <= 127
    assert torch.equal(w8.to(torch.float32)[inside], exact[inside])


def test_qqq_int8_weight_ties_go_to_even_and_128_wraps():
    # (code - 8) * s: 1 * 2.5 -> 2 (tie to even), -3 * 2.5 = -7.5 -> -8, 8 * 16 = 128 -> the low byte wraps to -128
    w = Int4Weight(torch.tensor([[9, 5, 15, 16 - 1]], dtype=torch.uint8),
                   torch.tensor([[2.5, 2.5, 16.0, 16.0]], dtype=torch.float16).reshape(1, 4), torch.ones(1), 1)
    w8 = qqq_int8_weight(w)
    assert w8.tolist() == [[2, -8, 112, 112]]
    wrap = Int4Weight(torch.tensor([[16 - 1]], dtype=torch.uint8), torch.tensor([[18.3]], dtype=torch.float16),
                      torch.ones(1), 1)
    assert qqq_int8_weight(wrap).tolist() == qqq_int8_weight_ref(wrap).tolist() == [[128 - 256]]


def test_w4a8_o8_and_o16_match_their_references():
    w = _weight(7, 256, 128, True, seed=3)
    codes = torch.randint(-128, 128, (2, 4, 256), generator=torch.Generator().manual_seed(2)).to(torch.int8)
    x = QTensor(codes, 0.02)
    y8 = w4a8_linear(x, w, out_int8=True)
    assert y8.dtype == torch.int8 and torch.equal(y8, w4a8_linear_ref(x, w, True))
    y16 = w4a8_linear(x, w, out_int8=False)
    assert torch.equal(y16, w4a8_linear_ref(x, w, False))


def test_w4a8_epilogue_multiplies_the_channel_scale_first():
    # fp32(acc) * s_ch * s_tok left to right (marlin_qqq_gemm_kernel.cuh:744-749); acc = 127*5 + 64*1 = 699 is a
    # case (found by search) where (acc * s_tok) * s_ch rounds to another fp16
    s_ch, s_tok = 0.005062565673142672, 0.039411090314388275
    w = Int4Weight(torch.tensor([[13, 9]], dtype=torch.uint8), torch.tensor([[1.0, 1.0]], dtype=torch.float16),
                   torch.tensor([s_ch]), 1)
    x = QTensor(torch.tensor([[127, 64]], dtype=torch.int8), s_tok)
    acc, ch, tok = torch.tensor(699.0), torch.tensor(s_ch), torch.tensor(s_tok)
    right, wrong = float(((acc * ch) * tok).to(torch.float16)), float(((acc * tok) * ch).to(torch.float16))
    assert right != wrong
    assert w4a8_linear(x, w, out_int8=False).item() == right == w4a8_linear_ref(x, w, False).item()
