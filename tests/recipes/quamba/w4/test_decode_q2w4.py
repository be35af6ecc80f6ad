"""q2-w4a8's and q2-w4a16's decode steps on the shipped models/mamba2-tiny (Quamba c474646 W4A8QMamba2.step,
qMamba2.py:997-1021: W8A8's step with the Marlin-QQQ linears; W4A16QMamba2.step, :641-685: the fp16 float step
with the Marlin linears): the linears the step runs, the states it carries, its prefill/decode consistency, the
stored keys of --decode and --generate."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import ROOT
from harness.checkpoints.loading import open_checkpoint
from harness.cli import capture_main
from harness.runner.backbone import build_backbone
from harness.kernels.w4_linear import w4a8_linear_ref, w4a16_linear_ref
from harness.recipes.registry import get_mode
from harness.runner.calibration import CalibrationSettings
from harness.recipes.quamba.families import calibrate_key as calibrate
from harness.runner.weightbank import WeightBank
from harness.store.reader import load_capture
from harness.store.format import stats_path
from helpers import rel_per_step, run_cli, teacher_forced_steps

TINY2 = ROOT / "models" / "mamba2-tiny"
L, N = 16, 6
DEPTH = 2


@pytest.fixture(scope="module")
def w4():
    bank = WeightBank(open_checkpoint(TINY2))
    gen = torch.Generator().manual_seed(0)
    windows = torch.randint(0, bank.dims.vocab_size, (4, 32), generator=gen)
    settings = CalibrationSettings(num_samples=4, seqlen=32, batch_size=4)
    calibs = {mode: calibrate(bank, windows, settings, DEPTH, [], None, get_mode(mode).calibration_key)
              for mode in ("q2-w4a8", "q2-w4a16")}
    ids = torch.randint(0, bank.dims.vocab_size, (1, L + N), generator=gen)
    return bank, calibs, ids


def _spy(block, name: str, got: list) -> None:
    """Record the first argument of block.<name> (an instance attribute over the method)."""
    inner = getattr(block, name)

    def spy(x, *rest):
        got.append(x)
        return inner(x, *rest)
    setattr(block, name, spy)


def test_w4a8_step_runs_the_marlin_qqq_in_proj_and_out_proj_and_keeps_int8_states(w4):
    """The step's in_proj is the W4A8B8O8 Marlin-QQQ kernel on one token (RNE, the GPTQ weights), not W8A8's GEMV
    with the W8A8 weights; out_proj the W4A8B16O16 one; the states are int8 codes at the W8A8 calibration's
    ssm_state_scale (W4A8 shares it)."""
    bank, calibs, ids = w4
    d = bank.dims
    model = build_backbone(get_mode("q2-w4a8"), bank, calibs["q2-w4a8"].scales, DEPTH)
    block = model.blocks[0]
    proj, had, normed = [], [], []
    _spy(block, "_tap_proj", proj)
    block.norm.register_forward_hook(lambda m, a, out: normed.append(out))
    _spy(block.out_proj, "step", had)
    _, kept = teacher_forced_steps(model, ids, L)
    assert len(proj) == N + 1 and len(had) == N    # the prefill's in_proj, then one per step
    for layer, blk in enumerate(model.blocks):
        s = kept[-1][layer]
        assert s.ssm_codes.dtype == torch.int8 and s.conv_codes.dtype == torch.int8
        assert s.ssm_codes.shape == (1, d.nheads, d.headdim, d.d_state)
        table = calibs["q2-w4a8"].scales[layer].scales.ssm_state_scale
        assert table is not None and table.shape == (d.ngroups, 4, 4, d.d_state)
        assert set(blk.state_scales.flatten().tolist()) <= set(table.flatten().tolist())
    # the last step's in_proj codes: the Marlin-QQQ oracle on that step's int8 norm output
    assert normed[-1].codes.shape == (1, 1, d.d_model)
    assert torch.equal(proj[-1], w4a8_linear_ref(normed[-1], block.w4_in, True))
    assert had[-1].codes.shape == (1, 1, d.d_inner)


def test_w4a16_step_keeps_fp16_states_and_runs_the_marlin_linears(w4):
    """The W4A16 step: mamba_ssm's fp16 conv and SSM caches (qMamba2.py:687-699), every state value an fp16 one;
    in_proj the Marlin W4A16 kernel on one token."""
    bank, calibs, ids = w4
    d = bank.dims
    model = build_backbone(get_mode("q2-w4a16"), bank, calibs["q2-w4a16"].scales, DEPTH)
    block = model.blocks[0]
    seen = []
    _spy(block.in_proj, "step", seen)
    _, kept = teacher_forced_steps(model, ids, L)
    assert len(seen) == N
    for s in kept[-1]:
        for t in (s.ssm, s.conv):
            assert torch.isfinite(t).all() and torch.equal(t.to(torch.float16).to(t.dtype), t)
        assert s.ssm.shape == (1, d.d_inner, d.d_state) and s.conv.shape == (1, d.conv_dim, d.d_conv)
    x = seen[-1]
    assert torch.equal(block.in_proj.step(x), w4a16_linear_ref(x, calibs["q2-w4a16"].scales[0].in_proj))


def test_prefill_decode_consistency_of_the_w4_steps_is_small(w4):
    """Step k's residual stream against the same mode's prefill of L + N tokens at L + k. Measured (mamba2-tiny,
    calibration 4 x 32, L = 16, 6 steps): q2-w4a8 0.018..0.135 per step (the int8 state, as q2-w8a8's 0.015..0.13);
    q2-w4a16 2.9e-4..5.2e-4 (fp16 states and the recurrence against the chunked prefill)."""
    bank, calibs, ids = w4
    got = {}
    for mode in ("q2-w4a8", "q2-w4a16"):
        model = build_backbone(get_mode(mode), bank, calibs[mode].scales, DEPTH)
        steps, _ = teacher_forced_steps(model, ids, L)
        got[mode] = rel_per_step(steps, model(ids)[:, L:])
        assert all(np.isfinite(got[mode])), got
    assert 1e-4 < max(got["q2-w4a8"]) < 0.3, got
    assert max(got["q2-w4a16"]) < 2e-3, got
    assert max(got["q2-w4a16"]) < 0.1 * max(got["q2-w4a8"]), got


def test_decode_and_generate_run_the_w4_modes(tmp_path, capsys):
    out = tmp_path / "d.npz"
    assert run_cli(capture_main, ["--model", TINY2, "--modes", "fp32", "q2-w4a8", "q2-w4a16", "--seq_len", "16",
                                  "--decode", "3", "--generate", "3", "--taps", "ssd.y", "--end-to-end",
                                  "--calib_data_num", "4", "--calib_seqlen", "64", "--no_cache",
                                  "--output_file", out, "--quiet"]) == 0, capsys.readouterr().err
    cap = load_capture(out)
    dims = open_checkpoint(TINY2).dims
    stats = json.loads(stats_path(out).read_text())
    for mode in ("q2-w4a8", "q2-w4a16"):
        ssm = cap.array(mode, "decode.L0.state.ssm")
        assert ssm.shape == (1, 3, dims.d_inner, dims.d_state) and np.isfinite(ssm).all()
        assert cap.array(mode, "decode.L0.state.conv").shape == (1, 3, dims.conv_dim, dims.d_conv)
        assert cap.array(mode, "decode.L0.ssd.y").shape == (1, 3, dims.d_inner)
        assert cap.array(mode, "decode.logits").shape == (1, 3, dims.vocab_size)
        assert cap.array(mode, "generated_ids").shape == (1, 3)
        entry = stats["modes"][mode]
        cons = entry["decode"]["consistency"]["decode.logits"]["rel_l2"]
        assert np.isfinite(cons) and cons > stats["modes"]["fp32"]["decode"]["consistency"]["decode.logits"]["rel_l2"]
        assert len(entry["decode"]["per_step"]["decode.L0.state.ssm"]["sqnr_db"]) == 3
        assert {"first_divergence", "agreement"} <= set(entry["generate"])
    by_prep = stats["provenance"]["calibration_by_prep"]
    assert np.array(by_prep["quamba2-w4a8"]["s_h"]).shape == (dims.n_layer, dims.ngroups, 4, 4, dims.d_state)
    assert "s_h" not in by_prep["quamba2-w4a16"]   # an fp16 state: no state scale
