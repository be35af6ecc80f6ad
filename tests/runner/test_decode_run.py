"""The teacher-forced decode run (--decode N, runner.decode): keys, shapes, stats, consistency, bad input."""
import json
import re

import numpy as np
import pytest

from harness.cli import capture_main
from harness.store.format import stats_path
from helpers import FAST_CLI, run_cli

L, N = 16, 4


@pytest.fixture(scope="module")
def decoded(tmp_path_factory):
    out = tmp_path_factory.mktemp("decode") / "X.npz"
    code = run_cli(capture_main, ["--modes", "fp32", "0", *FAST_CLI, "--decode", N, "--layers", "0", "1",
                                  "--taps", "all", "--end-to-end", "--output_file", out, "--quiet"])
    assert code == 0
    with np.load(out, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    return arrays, json.loads(stats_path(out).read_text())


def test_token_ids_hold_the_prompt_and_the_steps(decoded):
    arrays, stats = decoded
    assert arrays["token_ids"].shape == (1, L + N) and arrays["token_ids"].dtype == np.int64
    assert arrays["mode_0_input"].shape == (1, L, 192)   # the prefill arrays as before


def test_decode_arrays_have_the_step_axis_second(decoded):
    arrays, stats = decoded
    for m in ("fp32", "0"):
        assert arrays[f"mode_{m}__decode.L0.block.out"].shape == (1, N, 192)
        assert arrays[f"mode_{m}__decode.L1.ssm.out"].shape == (1, N, 384)
        assert arrays[f"mode_{m}__decode.L1.state.ssm"].shape == (1, N, 384, 16)
        assert arrays[f"mode_{m}__decode.L0.state.conv"].shape == (1, N, 384, 4)
        assert arrays[f"mode_{m}__decode.logits"].shape == (1, N, 4096)
    assert not any(k.endswith("decode.L0.ssm.state") for k in arrays)


def test_w8a8_states_are_int8_at_s_h_and_recorded(decoded):
    arrays, stats = decoded
    s_h = stats["provenance"]["calibration"]["s_h"]
    entry = stats["modes"]["0"]["tensors"]["decode.L1.state.ssm"]
    assert entry["kind"] == "int8" and entry["scale"] == s_h[1]
    ssm = arrays["mode_0__decode.L1.state.ssm"]
    assert np.array_equal(np.round(ssm / np.float32(s_h[1])) * np.float32(s_h[1]), ssm)   # on the s_h grid
    # the conv window holds the last 4 conv inputs: step k's newest column is step k's conv1d.in
    conv = arrays["mode_0__decode.L0.state.conv"]
    assert np.array_equal(conv[:, :, :, -1], arrays["mode_0__decode.L0.conv1d.in"])
    assert np.array_equal(conv[:, 1:, :, :-1], conv[:, :-1, :, 1:])


def test_per_step_comparison_and_consistency(decoded):
    _, stats = decoded
    dec = stats["modes"]["0"]["decode"]
    assert dec["prompt_len"] == L and dec["steps"] == N
    logits = dec["per_step"]["decode.logits"]
    assert len(logits["kl"]) == N and all(k > 0 for k in logits["kl"]) and len(logits["top1_agreement"]) == N
    assert len(dec["per_step"]["decode.L1.state.ssm"]["sqnr_db"]) == N
    assert "decode.L0.block.out" in stats["comparison"]["modes"]["0"]   # every metric over all steps
    fp32 = stats["modes"]["fp32"]["decode"]["consistency"]
    assert fp32["decode.L1.block.out"]["rel_l2"] < 1e-5 and fp32["decode.logits"]["rel_l2"] < 1e-5
    w8a8 = dec["consistency"]["decode.L1.block.out"]
    assert 1e-4 < w8a8["rel_l2"] < 0.2 and len(w8a8["per_step"]["rel_l2"]) == N


def test_a_text_too_short_for_the_steps_is_refused(tmp_path, capsys):
    text = tmp_path / "short.txt"
    text.write_text("one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
                    "sixteen seventeen eighteen")
    out = tmp_path / "X.npz"
    code = run_cli(capture_main, ["--modes", "fp32", "--seq_len", 16, "--decode", 64, "--text_file", text,
                                  "--output_file", out])
    err = capsys.readouterr().err
    assert code == 2 and "--decode 64 needs --seq_len 16 + 64 = 80 tokens" in err
    # Issue "What trying it found" 19: it said "fewer than --seq_len 80" and suggested only a shorter --seq_len
    n = int(re.search(r"it gives only (\d+) with this tokenizer", err).group(1))
    assert "--decode N adds N tokens" in err and "fewer than --seq_len 80" not in err
    assert f"use a smaller --decode (at most {n - 16} with --seq_len 16), a shorter --seq_len" in err
    assert not out.exists() and not stats_path(out).exists()


def test_decode_with_several_samples_is_refused(tmp_path, capsys):
    code = run_cli(capture_main, ["--modes", "fp32", "--seq_len", 8, "--decode", 2, "--samples", 2,
                                  "--output_file", tmp_path / "X.npz"])
    assert code == 2 and "--decode and --generate run one sample" in capsys.readouterr().err


def test_the_report_has_a_row_per_mode_and_step(decoded, tmp_path_factory):
    from harness.report.decoding import decode_section
    from types import SimpleNamespace
    _, stats = decoded
    html = decode_section(SimpleNamespace(stats=stats, reference="fp32"))
    assert html.count("<tr>") == 1 + 2 * N   # the header, then fp32 and 0 at each step
    kl = stats["modes"]["0"]["decode"]["per_step"]["decode.logits"]["kl"]
    assert f"<td>{kl[0]:.4g}</td>" in html


def test_a_rotated_basis_run_checks_consistency_in_the_original_basis(decoded, tmp_path):
    """--basis rotated keeps a rotated mode's steps as they are; the prefill-decode consistency takes them back
    to the original basis (Had^T) first, as the prefill it is compared with: the original-basis run's numbers."""
    out = tmp_path / "R.npz"
    assert run_cli(capture_main, ["--modes", "0", *FAST_CLI, "--decode", N, "--layers", "0", "1", "--taps", "all",
                                  "--end-to-end", "--basis", "rotated", "--output_file", out, "--quiet"]) == 0
    rotated = json.loads(stats_path(out).read_text())["modes"]["0"]["decode"]["consistency"]
    original = decoded[1]["modes"]["0"]["decode"]["consistency"]
    assert "decode.L1.block.out" in rotated and rotated == original  # the same Had^T of the same steps: bit for bit


def test_decode_steps_are_a_phase_on_stderr(tmp_path, capsys):
    """--decode N is a long phase too: its start (N steps) and end lines on a non-terminal stderr, per mode."""
    from conftest import make_hf_model, write_hf_dir
    model = write_hf_dir(tmp_path / "m", make_hf_model(d_model=16, n_layer=2, d_state=4, seed=4))
    assert run_cli(capture_main, ["--model", model, "--modes", "fp32", "0", *FAST_CLI, "--decode", 3, "--no_cache",
                                  "--output_file", tmp_path / "D.npz"]) == 0
    err = capsys.readouterr().err
    for mode in ("fp32", "0"):
        assert f"\ndecoding (mode {mode}) ... (3 steps)\ndecoding (mode {mode}): done in " in err
