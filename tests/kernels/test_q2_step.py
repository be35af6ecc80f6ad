"""Quamba2's W8A8 decode-step ops (harness.kernels.ssd_step) against their written-out loops of Quamba's
kernel order (enyac-group/Quamba c474646): the in_proj GEMV, the grouped conv-window update, the SSM state update
with its 1e6 re-quantization, the state-scale lookup and a saturating state."""
from __future__ import annotations

import numpy as np
import torch

from harness.kernels.ssd_inputs import Q2SSDParams
from harness.kernels.ssd_step import (dequantize_q2_state, q2_conv_pre_act, handover_q2_state, q2_conv_update, q2_conv_update_ref,
                                           q2_gemv, q2_gemv_ref, q2_state_scales, q2_state_update,
                                           q2_state_update_ref, requantize_q2_state)
from harness.kernels.conv1d_grouped import x_channel_scales
from harness.spec import QTensor


def _codes(gen, *shape, lo=-128, hi=128):
    return torch.randint(lo, hi, shape, generator=gen, dtype=torch.int64).to(torch.int8)


def test_gemv_equals_its_loop_and_rounds_half_away():
    gen = torch.Generator().manual_seed(0)
    x = QTensor(_codes(gen, 1, 1, 64), 0.013)
    w = _codes(gen, 21, 64)
    b = torch.linspace(0.0005, 0.3, 21, dtype=torch.float32)  # per-column f32(s_w / s_out): small to saturating
    got = q2_gemv(x, w, b)
    assert got.shape == (1, 1, 21) and torch.equal(got, q2_gemv_ref(x, w, b))
    assert got.dtype == torch.int8  # codes, as the next op takes them (torch.equal ignores the dtype)
    assert ((got == 127) | (got == -128)).any() and (got.abs() < 100).any()
    # a tie: b * a * acc = 0.5 * 1 * 5 = 2.5 -> 3 (roundf, half away), where the prefill GEMM's RNE gives 2
    one = QTensor(torch.tensor([[5]], dtype=torch.int8), 1.0)
    w1 = torch.tensor([[1], [-1]], dtype=torch.int8)
    tie = q2_gemv(one, w1, torch.tensor([0.5, 0.5]))
    assert tie.tolist() == [[3, -3]] and torch.equal(tie, q2_gemv_ref(one, w1, torch.tensor([0.5, 0.5])))


def _conv_case(gen, bias: bool):
    x_dim, bc, K = 8, 4, 4
    conv_dim = x_dim + 2 * bc
    weight = _codes(gen, conv_dim, K)
    b = _codes(gen, conv_dim) if bias else None
    conv = (weight, (0.011, 0.017, 0.013), b, (0.02, 0.03, 0.025))
    out_scales = torch.rand(conv_dim, generator=gen) * 0.02 + 0.004
    return conv, out_scales, x_dim, conv_dim, K


def test_conv_update_equals_its_loop():
    gen = torch.Generator().manual_seed(1)
    for bias in (True, False):
        conv, out_scales, x_dim, conv_dim, K = _conv_case(gen, bias)
        window, x_t = _codes(gen, 2, conv_dim, K), _codes(gen, 2, conv_dim)
        in_scales = (0.05, 0.04, 0.03)
        got, win = q2_conv_update(window, x_t, in_scales, conv, out_scales, x_dim=x_dim)
        want, want_win = q2_conv_update_ref(window, x_t, in_scales, conv, out_scales, x_dim=x_dim)
        assert torch.equal(got, want) and torch.equal(win, want_win)
        assert torch.equal(win[..., :-1], window[..., 1:]) and torch.equal(win[..., -1], x_t)
        assert got.dtype == torch.int8 and len(set(got.flatten().tolist())) > 5


def test_conv_update_chains_one_fma_per_tap_from_the_bias():
    """The sum before SiLU: v = f32(s_b·b), then fma(f32(scale_in·w_k), x_k, v) for k = 0..3, one rounding each
    (quamba2_conv1d_update_kernel.cuh:139-141); it differs in the last bit from rounding every product first."""
    from harness.kernels.step import fma_f32_exact
    gen = torch.Generator().manual_seed(5)
    conv, _, x_dim, conv_dim, K = _conv_case(gen, True)
    win = _codes(gen, 3, conv_dim, K)
    scales = (0.0517, 0.0413, 0.0311)
    got = q2_conv_pre_act(win, scales, conv, x_dim=x_dim)
    weight, w_scales, bias, b_scales = conv
    f = np.float32
    fused, unfused = torch.empty(3, conv_dim), torch.empty(3, conv_dim)
    for n in range(3):
        for c in range(conv_dim):
            s = 0 if c < x_dim else (1 if c < x_dim + 4 else 2)
            si = f(f(w_scales[s]) * f(scales[s]))
            v = u = f(f(b_scales[s]) * f(int(bias[c])))
            for k in range(K):
                v = fma_f32_exact(f(si * f(int(weight[c, k]))), f(int(win[n, c, k])), v)
                u = f(u + f(f(si * f(int(weight[c, k]))) * f(int(win[n, c, k]))))
            fused[n, c], unfused[n, c] = float(v), float(u)
    assert torch.equal(got, fused) and not torch.equal(got, unfused)


def test_state_scale_lookup_agrees_with_the_conv_kernels_x_lookup():
    """The Triton kernels' sum-of-where lookup (selective_state_update.py:300-321) and the conv kernel's loops
    (quamba2_conv1d_fwd_kernel.cuh:174-197, kernels.conv1d_grouped.x_channel_scales) pick the same (head group, dim group)."""
    head_range = torch.tensor([[1, 3, 4, 6], [2, 3, 5, 6]], dtype=torch.int32)       # 6 heads per SSD group
    dim_range = torch.tensor([[[1, 2, 3, 4], [2, 2, 3, 4], [1, 3, 3, 4], [4, 4, 4, 4]],
                              [[1, 2, 3, 4], [3, 3, 3, 4], [1, 1, 2, 4], [2, 3, 4, 4]]], dtype=torch.int32)
    x_table = torch.arange(1, 33, dtype=torch.float32).reshape(2, 4, 4) / 100
    N = 3
    table = x_table[..., None] * torch.tensor([1.0, 10.0, 100.0])
    got = q2_state_scales(table, head_range, dim_range, nheads=12, headdim=4)
    x = x_channel_scales(x_table, head_range, dim_range, x_dim=48, headdim=4).reshape(12, 4)
    assert torch.equal(got, x[..., None] * torch.tensor([1.0, 10.0, 100.0])) and got.shape == (12, 4, N)


def _ssm_case(gen, ngroups=2, nheads=4, headdim=3, N=5, state_mag=1.0):
    p = Q2SSDParams(A_log=QTensor(_codes(gen, nheads), 0.02), D=QTensor(_codes(gen, nheads), 0.01),
                    dt_bias=(torch.randn(nheads, generator=gen) - 2).to(torch.float16).float(), dt_scale=0.015,
                    chunk_size=8)
    scales = torch.rand(nheads, headdim, N, generator=gen) * 0.01 + 0.002
    codes = _codes(gen, 2, nheads, headdim, N)
    args = dict(q_x=_codes(gen, 2, nheads, headdim), x_scales=torch.rand(nheads, headdim, generator=gen) * 0.05 * state_mag,
                q_dt=_codes(gen, 2, nheads), q_B=_codes(gen, 2, ngroups, N), B_scales=torch.tensor([0.02, 0.03])[:ngroups],
                q_C=_codes(gen, 2, ngroups, N), C_scales=torch.tensor([0.025, 0.015])[:ngroups])
    return p, scales, codes, args


def test_state_update_equals_its_loop():
    gen = torch.Generator().manual_seed(3)
    for ngroups in (1, 2):
        p, scales, codes, a = _ssm_case(gen, ngroups=ngroups)
        y, new, dt = q2_state_update(p, dequantize_q2_state(codes, scales), a["q_x"], a["x_scales"], a["q_dt"],
                                     q_B=a["q_B"], B_scales=a["B_scales"], q_C=a["q_C"], C_scales=a["C_scales"])
        q = requantize_q2_state(new, scales)
        y_ref, q_ref, new_ref = q2_state_update_ref(p, codes, scales, a["q_x"], a["x_scales"], a["q_dt"], q_B=a["q_B"],
                                                    B_scales=a["B_scales"], q_C=a["q_C"], C_scales=a["C_scales"])
        assert torch.equal(new, new_ref) and torch.equal(q, q_ref) and torch.equal(y, y_ref)
        assert dt.shape == (2, 4) and bool((dt > 0).all())
        assert torch.equal(y, y.to(torch.float16).float()) and not torch.equal(q, codes)


def test_a_saturating_state_clamps_at_127():
    """A state larger than 127.5 scales after the step: its codes clamp at ±127 / -128, and the y of that step
    still reads the unclamped fp32 state (selective_state_update.py:355-357)."""
    gen = torch.Generator().manual_seed(4)
    p, scales, codes, a = _ssm_case(gen, state_mag=400.0)
    h = dequantize_q2_state(codes, scales)
    y, new, _ = q2_state_update(p, h, a["q_x"], a["x_scales"], a["q_dt"], q_B=a["q_B"], B_scales=a["B_scales"],
                                q_C=a["q_C"], C_scales=a["C_scales"])
    q = requantize_q2_state(new, scales)
    over = (new / scales).abs() > 128
    assert over.any() and bool((q[over].to(torch.int32).abs() >= 127).all())
    assert int((q == 127).sum()) > 0 and int((q == -128).sum()) > 0
    assert (dequantize_q2_state(q, scales) - new).abs().max() > 10 * scales.max()   # what the clamp loses
    _, q_ref, _ = q2_state_update_ref(p, codes, scales, a["q_x"], a["x_scales"], a["q_dt"], q_B=a["q_B"],
                                      B_scales=a["B_scales"], q_C=a["q_C"], C_scales=a["C_scales"])
    assert torch.equal(q, q_ref)


def test_requantization_rounds_half_to_even_and_the_handover_goes_through_fp16():
    s = torch.full((1, 1, 1, 4), 0.5)
    h = torch.tensor([0.25, 0.75, -0.25, 1000.0]).reshape(1, 1, 1, 4)
    assert requantize_q2_state(h, s).flatten().tolist() == [0, 2, 0, 127]
    s1 = torch.full((1, 1, 1, 1), 0.5)
    h3 = torch.tensor([0.7499]).reshape(1, 1, 1, 1)       # below the tie in fp32 (code 1); the hand-over's fp16 makes it 0.75: a tie -> 2
    assert requantize_q2_state(h3, s1).item() == 1 and handover_q2_state(h3, s1).item() == 2
