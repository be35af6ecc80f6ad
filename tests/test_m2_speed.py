"""Mamba-2 run costs cut with every result unchanged bit for bit (docs/performance.md "Mamba-2"): each faster
path is compared with the plain computation it replaces, in the same process."""
from __future__ import annotations

import math

import pytest
import torch

from harness.emulation.ops import hadamard as H
from harness.emulation.ops.quant import round_to_dtype
from harness.runner import forwards


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("n", [64, 12 * 16, 40 * 8, 768])
def test_hadamard_in_row_blocks_equals_one_pass(n, monkeypatch):
    """Blocks of rows (a last block shorter than the others) vs every row in one pass."""
    monkeypatch.setattr(H, "_ROWS_ELEMENTS", 3 * n)
    g = torch.Generator().manual_seed(n)
    for x in (torch.randn(4, 5, n, generator=g), torch.randn(11, n, generator=g).to(torch.float16),
              torch.randn(2, n, generator=g, dtype=torch.float64) * 1e3, torch.randn(n, generator=g)):
        for normalized in (True, False):
            for transpose in (True, False):
                got = H.hadamard_transform(x, normalized, transpose)
                want = H._hadamard_rows(x.reshape(-1, n), normalized, transpose).reshape(x.shape)
                assert _same(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotated_head_in_blocks_equals_the_whole_head(dtype, monkeypatch):
    """forwards.rotated_head vs the formula over the whole head at once (as _float_head computed it)."""
    monkeypatch.setattr(forwards, "_HEAD_ROWS", 7)
    g = torch.Generator().manual_seed(1)
    w = round_to_dtype(torch.randn(30, 96, generator=g) * 0.02, dtype)
    norm_w = round_to_dtype(1 + 0.1 * torch.randn(96, generator=g), dtype)
    folded = round_to_dtype(w.to(torch.float64) * norm_w.to(torch.float64), dtype)
    want = round_to_dtype(H._hadamard_rows(folded, True, False), dtype)
    assert _same(forwards.rotated_head(w, norm_w, dtype), want)


@pytest.mark.parametrize("seq", [1, 65, 130])
def test_end_to_end_metrics_share_log_probs_bit_for_bit(seq):
    """One log_softmax per chunk for KL and cross-entropy (and one for the reference against itself) vs the two
    functions computed apart, at chunk boundaries inside and at the end of the window; a wide vocabulary."""
    from harness.metrics import logits as M

    g = torch.Generator().manual_seed(seq)
    ref = torch.randn(1, seq, 50280, generator=g) * 4
    mode = ref + 0.1 * torch.randn(1, seq, 50280, generator=g)
    ids = torch.randint(0, 50280, (1, seq), generator=g)
    for a, b in ((ref, mode), (ref, ref), (ref.numpy(), ref.numpy())):
        got = M.end_to_end_metrics(a, b, ids.numpy())
        ce = M.cross_entropy(b, ids)
        want = {"kl": M.kl_divergence(a, b), "cross_entropy": ce, "top1_agreement": M.top1_agreement(a, b)}
        for key, value in want.items():
            assert got[key] == value or (math.isnan(got[key]) and math.isnan(value)), key


def test_chunked_ssd_decay_on_the_triangle_equals_the_masked_square():
    """The chunk's decay with exp on the lower triangle only vs exp over the masked square (-inf above the
    diagonal): chunk lengths 1, 5 and 256, several heads and batches, large, infinite and NaN sums included."""
    from harness.emulation.ops import ssd

    g = torch.Generator().manual_seed(5)
    for b, q, h in ((1, 1, 3), (2, 5, 4), (1, 256, 24)):
        acs = torch.cumsum(-torch.rand(b, q, h, generator=g) * 3, dim=1)
        cases = [acs, acs * 100]
        if q > 2:
            odd = acs.clone()
            odd[0, 1, 0], odd[0, 2, 1] = -torch.inf, torch.nan
            cases.append(odd)
        for a in cases:
            assert _same(ssd._causal_decay(a), ssd._causal_decay_square(a))
