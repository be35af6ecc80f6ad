"""GPTQ (emulation.gptq) against a hand-computed small case, and the Int4Weight it makes as Marlin does."""
from __future__ import annotations

import math

import torch

from harness.emulation.gptq import Hessian, gptq_group_size, gptq_int4, marlin_codes, to_int4_weight

X = [[1.0, 0.5, -0.25, 2.0], [0.0, -1.0, 0.75, 0.5], [1.5, 0.25, 0.5, -1.0]]  # 3 tokens x 4 inputs
W = [[0.9, -0.4, 0.3, 0.05], [-0.2, 0.7, -0.6, 0.35]]                         # 2 outputs x 4 inputs


def _hessian(rows: list[list[float]], n_seq: int) -> list[list[float]]:
    """2/n sum x x^T over every token of n_seq sequences (gptq_utils.py:105-119 with one sequence per call)."""
    n = len(rows[0])
    return [[2.0 / n_seq * sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]


def _cholesky(a: list[list[float]]) -> list[list[float]]:
    n = len(a)
    low = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1):
            s = a[i][j] - sum(low[i][k] * low[j][k] for k in range(j))
            low[i][j] = math.sqrt(s) if i == j else s / low[j][j]
    return low


def _inverse(a: list[list[float]]) -> list[list[float]]:
    n = len(a)
    m = [row[:] + [float(i == j) for j in range(n)] for i, row in enumerate(a)]
    for c in range(n):
        p = m[c][c]
        m[c] = [v / p for v in m[c]]
        for r in range(n):
            if r != c:
                f = m[r][c]
                m[r] = [v - f * w for v, w in zip(m[r], m[c])]
    return [row[n:] for row in m]


def _hand_gptq(w: list[list[float]], h: list[list[float]], group: int) -> tuple[list[list[float]], list[list[float]]]:
    """GPTQ by hand: damp 1 % of mean(diag H), U = upper Cholesky of H^-1; per column: scale from the group's
    current (updated) weights, q = (clamp(round(w/s) + 8, 0, 15) - 8) * s in fp16, the error / U_ii spread
    over the later columns with U's row."""
    n = len(h)
    damp = 0.01 * sum(h[i][i] for i in range(n)) / n
    hd = [[h[i][j] + (damp if i == j else 0.0) for j in range(n)] for i in range(n)]
    low = _cholesky(_inverse(hd))
    u = [[low[j][i] for j in range(n)] for i in range(n)]  # upper factor: U^T U = H^-1
    w = [row[:] for row in w]
    q = [[0.0] * n for _ in w]
    scales = [[0.0] * (n // group) for _ in w]
    for r, row in enumerate(w):
        for i in range(n):
            if i % group == 0:
                # float32 as Quamba's `s *= 2 / 15` on a float32 tensor (gptq_utils.py:70-71)
                amax = torch.tensor(max(abs(v) for v in row[i:i + group]), dtype=torch.float32)
                scales[r][i // group] = float(amax * (2 / 15))
            s = scales[r][i // group]
            code = min(15, max(0, round(row[i] / s) + 8))
            q[r][i] = float(torch.tensor((code - 8) * s).to(torch.float16))
            err = (row[i] - q[r][i]) / u[i][i]
            for j in range(i + 1, n):
                row[j] -= err * u[i][j]
    return q, scales


def _run(group: int):
    hess = Hessian(4, torch.float64)
    hess.add(torch.tensor(X[:2], dtype=torch.float64).unsqueeze(0))  # sequence 1: two tokens
    hess.add(torch.tensor(X[2:], dtype=torch.float64))               # sequence 2: one token (2-D input)
    assert hess.nsamples == 2
    h_hand = _hessian(X, 2)
    assert torch.allclose(hess.H, torch.tensor(h_hand, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    q, s = gptq_int4(torch.tensor(W), hess.H, group_size=group, dtype=torch.float64)
    return q, s, _hand_gptq(W, h_hand, group)


def test_gptq_one_group_matches_the_hand_computation():
    q, s, (q_hand, s_hand) = _run(4)
    assert torch.equal(q, torch.tensor(q_hand, dtype=torch.float32))
    assert torch.allclose(s, torch.tensor(s_hand, dtype=torch.float32), rtol=1e-6)


def test_gptq_two_groups_take_the_second_scale_from_the_updated_weights():
    q, s, (q_hand, s_hand) = _run(2)
    assert torch.equal(q, torch.tensor(q_hand, dtype=torch.float32))
    assert torch.allclose(s, torch.tensor(s_hand, dtype=torch.float32), rtol=1e-6)
    # the updates moved the second group: its scale is not the one of the original weights
    orig = [max(abs(v) for v in row[2:]) * 2 / 15 for row in W]
    assert all(abs(a - b) > 1e-3 for a, b in zip(s[:, 1].tolist(), orig))
    # and the error feedback changed some code compared with plain round-to-nearest
    rtn = [[float(torch.tensor((min(15, max(0, round(v / (max(abs(x) for x in row[g:g + 2]) * 2 / 15))) + 8) - 8)
                               * max(abs(x) for x in row[g:g + 2]) * 2 / 15).to(torch.float16))
            for g in (0, 2) for v in row[g:g + 2]] for row in W]
    assert q.tolist() != rtn


def test_gptq_float32_as_quamba_gives_the_same_codes_here():
    hess = Hessian(4)
    hess.add(torch.tensor(X).unsqueeze(0))
    q32, s32 = gptq_int4(torch.tensor(W), hess.H, group_size=2)
    q64, s64 = gptq_int4(torch.tensor(W), hess.H.to(torch.float64), group_size=2, dtype=torch.float64)
    assert torch.equal(q32, q64) and torch.allclose(s32, s64, rtol=1e-6)
    # dtype is the whole computation's, the Hessian's inverse included: an fp32 Hessian is cast first
    q64b, s64b = gptq_int4(torch.tensor(W), hess.H, group_size=2, dtype=torch.float64)
    assert torch.equal(q64b, q64) and torch.equal(s64b, s64)


def test_dead_columns_are_zeroed():
    hess = Hessian(4)
    x = torch.tensor(X)
    x[:, 1] = 0
    hess.add(x.unsqueeze(0))
    q, _ = gptq_int4(torch.tensor(W), hess.H, group_size=4)
    assert torch.equal(q[:, 1], torch.zeros(2))


def test_group_size_is_128_or_the_row():
    assert gptq_group_size(768) == 128 and gptq_group_size(384) == 128
    assert gptq_group_size(192) == 192 and gptq_group_size(64) == 64


def test_int4_weight_recovers_gptq_codes_and_values():
    torch.manual_seed(0)
    w = torch.randn(8, 256)
    x = torch.randn(1, 64, 256)
    hess = Hessian(256)
    hess.add(x)
    q, s = gptq_int4(w.to(torch.float16).to(torch.float32), hess.H)
    iw = to_int4_weight(q, s, channel=False)
    assert iw.group_size == 128 and iw.codes.dtype == torch.uint8
    back = (iw.codes.to(torch.float32) - 8) * iw.group_scales.to(torch.float32).repeat_interleave(128, 1)
    # fp16 values of (code - 8) * s: the same as GPTQ's fake-quantized weight up to the fp16 scale rounding
    assert torch.allclose(back, q, rtol=2e-3, atol=1e-6)
    codes_direct = torch.clamp(torch.round(q / s.repeat_interleave(128, 1)) + 8, 0, 15).to(torch.uint8)
    assert torch.equal(iw.codes, codes_direct)
    qqq = to_int4_weight(q, s, channel=True)
    assert torch.equal(qqq.codes, iw.codes)
    ch = (q.to(torch.float16).abs().amax(1) / 127.0).to(torch.float32)
    assert torch.equal(qqq.channel_scales, ch)


def test_marlin_codes_zero_scale_gives_code_zero():
    q = torch.zeros(1, 4)
    assert marlin_codes(q, torch.zeros(1, 1)).tolist() == [[0, 0, 0, 0]]
