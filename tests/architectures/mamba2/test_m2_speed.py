"""Mamba-2 run costs cut with every result unchanged bit for bit (docs/performance.md "Mamba-2"): each faster
path is compared with the plain computation it replaces, in the same process."""
from __future__ import annotations

import math

import pytest
import torch

from harness.kernels import hadamard as H
from harness.kernels.quant import round_to_dtype
from harness.runner import forwards, headprep


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
    """headprep.rotated_head vs the formula over the whole head at once (as _float_head computed it)."""
    monkeypatch.setattr(headprep, "_HEAD_ROWS", 7)
    g = torch.Generator().manual_seed(1)
    raw = torch.randn(30, 96, generator=g) * 0.02
    norm_w = round_to_dtype(1 + 0.1 * torch.randn(96, generator=g), dtype)
    for w in (raw, raw.to(torch.bfloat16), round_to_dtype(raw, dtype)):  # the checkpoint's head, any float dtype
        rounded = round_to_dtype(w.to(torch.float32), dtype)
        folded = round_to_dtype(rounded.to(torch.float64) * norm_w.to(torch.float64), dtype)
        want = round_to_dtype(H._hadamard_rows(folded, True, False), dtype)
        assert _same(headprep.rotated_head(w, norm_w, dtype), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_head_rounds_its_logits_in_place_as_float_linear(dtype, monkeypatch):
    """Head.forward (the logits rounded in place, by rows) vs float_linear's output rule, bit for bit."""
    from harness.emulation.modules import EmuRMSNorm
    from harness.kernels.linear import float_linear
    from harness.spec import FloatOut

    monkeypatch.setattr(headprep, "_ROUND_ROWS", 5)
    g = torch.Generator().manual_seed(2)
    w = round_to_dtype(torch.randn(300, 48, generator=g), dtype)
    head = forwards.Head(EmuRMSNorm(None, 1e-5, FloatOut(dtype)), w, FloatOut(dtype))
    residual = torch.randn(2, 13, 48, generator=g) * 30
    want = float_linear(head.norm(residual), w, FloatOut(dtype))
    assert _same(head(residual), want)


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
    from harness.kernels import ssd

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


def test_shared_ops_keep_only_for_later_modes_and_release_by_tag():
    """keep=False computes and reuses but keeps nothing new; release drops the calls of a tag and their bytes."""
    from harness.runner.sharedops import SharedOps

    class Twice(torch.nn.Module):
        def forward(self, x):
            return x * 2

    op, x, y = Twice(), torch.ones(4), torch.full((4,), 3.0)
    shared = SharedOps()
    shared.tag = "a"
    first = shared.call(0, "op", op, op, x)
    shared.keep, shared.tag = False, "b"
    assert shared.call(0, "op", op, op, x) is first             # an earlier kept result is still taken
    shared.call(0, "op", op, op, y)                              # computed, not kept
    assert shared.summary()["reused"] == 1 and shared.kept_bytes == 2 * 16
    shared.release({"b"})
    assert shared.kept_bytes == 0 and shared.call(0, "op", op, op, x) is not first


def test_a_run_keeps_shared_results_only_while_a_later_mode_can_take_them(tmp_path):
    """Mamba-1 fp32 0 2-0: 0 and 2-0 (one weight variant) still share, fp32 keeps nothing, and nothing is held
    at the end; Mamba-2 fp32 1 (no two modes with one variant): nothing kept at all."""
    import shutil

    from conftest import ROOT, make_hf_model, write_hf_dir
    from helpers import run_modes
    from mamba2_fixtures import make_mamba2

    m1 = write_hf_dir(tmp_path / "m1", make_hf_model(d_model=24, n_layer=2, seed=1))
    (tmp_path / "o1").mkdir()
    (tmp_path / "o2").mkdir()
    ops = run_modes(m1, tmp_path / "o1", ["fp32", "0", "2-0"], layers=["all"]).stats["provenance"]["shared_ops"]
    assert ops["reused_by_op"]["norm"] == 2 and ops["kept_mb"] == 0, ops
    m2 = tmp_path / "m2"
    make_mamba2(m2, layers=2, vocab=4096, seed=2, tie=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(ROOT / "models" / "mamba-tiny" / name, m2 / name)
    ops = run_modes(m2, tmp_path / "o2", ["fp32", "1"], layers=["all"], seq_len=24,
                    isolated=True).stats["provenance"]["shared_ops"]
    assert ops["calls"] > 0 and ops["reused"] == 0 and ops["kept_mb"] == 0, ops



def test_q2_params_hold_no_float_copy_of_the_quantized_linears(tmp_path):
    """q2_params keeps in_proj and out_proj as int8 codes only (the fp16 float matrices shape-only, meta), the
    codes those of the reordered, folded, rotated fp16 weights; the block's output is unchanged by it."""
    from harness.checkpoints.loading import open_checkpoint
    from harness.kernels.quant import quantize_weight_fp16
    from harness.recipes.quamba.q2.params import q2_params, reorder_raw
    from harness.architectures.mamba2.weights import float_layer_mamba2
    from harness.runner.calibration import CalibrationSettings
    from harness.recipes.quamba.families import calibrate_key as calibrate
    from harness.runner.weightbank import WeightBank
    from mamba2_fixtures import make_mamba2

    make_mamba2(tmp_path, ngroups=1, layers=1, seed=3, headdim=4)
    bank = WeightBank(open_checkpoint(tmp_path))
    windows = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    s = calibrate(bank, windows, CalibrationSettings(4, 16), 0, [], None, "quamba2").scales[0]
    d = bank.dims
    p = q2_params(bank.raw(0), s, d)
    full = float_layer_mamba2(reorder_raw(bank.raw(0), s.reorder, d.d_inner, d.nheads), True, torch.float16)
    assert p.fp16.in_proj.is_meta and p.fp16.out_proj.is_meta
    assert p.fp16.in_proj.shape == full.in_proj.shape and p.fp16.out_proj.shape == full.out_proj.shape
    want = quantize_weight_fp16(full.out_proj)
    assert p.out_proj.scale == want.scale and torch.equal(p.out_proj.codes, want.codes)


def test_reference_ssd_in_buffers_equals_the_allocating_recurrence():
    """ssd_ref (in-place state, buffers) vs the recurrence with a new tensor per op: y and the final state bit for
    bit, from zeros and from a given state (left unchanged), batches of 1 and 2, one and several SSD groups."""
    from harness.kernels import ssd

    g = torch.Generator().manual_seed(7)
    for b, L, h, p, n, groups in ((1, 16, 24, 64, 128, 1), (2, 9, 8, 4, 16, 2), (1, 1, 4, 8, 8, 4)):
        x, dt = torch.randn(b, L, h, p, generator=g), torch.rand(b, L, h, generator=g) * 0.5
        A_log, D = torch.rand(h, generator=g) * 2, torch.randn(h, generator=g)
        B, C = torch.randn(b, L, groups, n, generator=g), torch.randn(b, L, groups, n, generator=g)
        for h0 in (None, torch.randn(b, h, p, n, generator=g)):
            before = None if h0 is None else h0.clone()
            got, want = ssd.ssd_ref(x, dt, A_log, B, C, D, h0), ssd._ssd_ref_allocating(x, dt, A_log, B, C, D, h0)
            assert _same(got[0], want[0]) and _same(got[1], want[1])
            assert h0 is None or torch.equal(h0, before)
