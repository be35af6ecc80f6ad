"""The quamba-se recipe (the fork 798253405/Quamba-SE's modes) on the shipped Mamba-1 model: every mode runs, and
each tap is what the mode's arithmetic (kernels.vquant) gives on that run's own conv output and scales."""
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import FAST_CLI, run_cli, run_modes
from harness.cli import capture_main
from harness.kernels import vquant as V
from harness.modes import ModeError
from harness.recipes.registry import get_mode, recipe_for, resolve_modes
from harness.recipes.se.modes import AS_WRITTEN, SE_KNOBS
from harness.runner.calibration import CalibrationSettings
from harness.runner.config import RunError

SHIPPED = Path(__file__).resolve().parents[3] / "models" / "mamba-tiny"
CALIB = CalibrationSettings(num_samples=4, seqlen=16, alpha=0.9995, batch_size=2, seed=42)
MODES = ["fp32", "0", *AS_WRITTEN, "6-2+fixed", "5-4+fixed", "5-6+fixed", "5-7+fixed", "5-0+exactdiv"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return run_modes(SHIPPED, tmp_path_factory.mktemp("se"), MODES, seq_len=16, calib=CALIB, taps=["all"])


def _t(run, mode, tap):
    return torch.from_numpy(np.asarray(run.by_mode[mode][f"L0.{tap}"], dtype=np.float32))


def _s(run, mode="5-0"):
    return run.stats["modes"][mode]["tensors"]["L0.x_proj.in"]["scale"]


def test_every_mode_runs_on_the_shipped_model(run):
    assert {m: run.stats["modes"][m]["status"] for m in MODES} == {m: "ok" for m in MODES}
    assert run.stats["modes"]["5-4"]["recipe"]["family"] == "quamba-se"
    assert run.stats["modes"]["6-2"]["family_knobs"] == {
        "u": "outlier", "u_round": "rne", "xproj": "fp", "xproj_round": "rne", "xproj_out": "fp", "dt_out": "fp",
        "scan": "mamba", "conv": "kernel", "a_scale": "false", "u_order": "blocked", "div": "recip"}
    assert "family_knobs" not in run.stats["modes"]["0"]


def test_conv_output_is_the_fp32_kernel_value_and_mode4_its_own(run):
    x_c = _t(run, "5-0", "conv1d.out")
    for m in ("5-1", "5-7", "6-0", "6-4"):
        assert torch.equal(_t(run, m, "conv1d.out"), x_c), m
    m4 = _t(run, "4", "conv1d.out")
    assert torch.allclose(m4, x_c, rtol=1e-4, atol=1e-5) and not torch.equal(m4, x_c)
    # mode 4 = 5-2 with RNE, the torch conv and 9688b7a's PyTorch scan: the fp32 states differ in the last bits
    # (its fp16 output y rounds them away on this model: mode 4's numbers are 5-2's, docs/se-modes.md)
    assert not torch.equal(_t(run, "4", "ssm.state"), _t(run, "5-2", "ssm.state"))


@pytest.mark.parametrize("mode", ["5-0", "5-2", "5-3", "5-4", "5-6", "5-7", "6-0", "6-2", "6-3", "5-0+exactdiv"])
def test_u_is_the_modes_quantizer_of_the_conv_output(run, mode):
    from harness.recipes.se.block import SeScales, quantize_u
    x_c, s = _t(run, mode, "conv1d.out"), _s(run)
    want = quantize_u(x_c, SE_KNOBS[mode], SeScales(s, 1.0, 1.0)).u
    assert torch.equal(_t(run, mode, "ssm.u"), want)


def test_fp32_u_modes_hand_the_conv_output_to_the_scan(run):
    for m in ("5-1", "6-1"):
        assert torch.equal(_t(run, m, "ssm.u"), _t(run, m, "conv1d.out"))


def test_xproj_codes_rna_vs_rne_and_the_re_rounding(run):
    x_c, s = _t(run, "5-0", "conv1d.out"), _s(run)
    codes_50 = V.xproj_codes(x_c, s, "rna").codes.float() * torch.tensor(s)
    assert torch.equal(_t(run, "5-0", "x_proj.in"), codes_50)
    assert torch.equal(_t(run, "5-1", "x_proj.in"), codes_50)
    for m in ("5-4", "5-6", "5-7"):  # as written: the mixed value re-rounded; +fixed: 5-0's codes
        u = _t(run, m, "ssm.u")
        assert torch.equal(_t(run, m, "x_proj.in"), V.xproj_codes(u, s, "rna").codes.float() * torch.tensor(s))
        assert torch.equal(_t(run, f"{m}+fixed", "x_proj.in"), codes_50)
    assert not torch.equal(_t(run, "5-6", "x_proj.in"), codes_50)  # the log2 grid reaches x_proj


def test_6x_x_proj_is_float_on_u(run):
    assert torch.equal(_t(run, "6-3", "x_proj.in"), _t(run, "6-3", "ssm.u"))
    xo = run.stats["modes"]["6-0"]["tensors"]["L0.x_proj.out"]
    assert xo.get("scale") is not None  # 6-0: x_dbl virtual int8 at B_scale


def test_6_2_as_written_forgets_a_scale(run):
    """Same u, x_proj and dt; only A differs: -exp(A_log_q) instead of -exp(A_log_q * A_scale)."""
    assert torch.equal(_t(run, "6-2", "ssm.u"), _t(run, "6-2+fixed", "ssm.u"))
    assert torch.equal(_t(run, "6-2", "dt_proj.out"), _t(run, "6-2+fixed", "dt_proj.out"))
    assert not torch.allclose(_t(run, "6-2", "ssm.out"), _t(run, "6-2+fixed", "ssm.out"))


def test_6_4_reads_a_second_calibration_at_alpha_one(run):
    by_key = run.stats["provenance"]["calibration_by_prep"]
    s_out = by_key["quamba+pa1"]["s_out"][0]
    assert s_out >= _s(run) * 0.999 and by_key["quamba+pa1"]["pa1"]["settings"]["alpha"] == 1.0
    x_c = _t(run, "6-4", "conv1d.out")
    want = V.vq_dual(x_c, _s(run), s_out, "rne").u  # its s is the alpha=0.9995 calibration's, as 5-0's
    assert torch.equal(_t(run, "6-4", "ssm.u"), want)


def test_presets():
    assert [r.name for r in resolve_modes(["5"])] == ["fp32", "5-0", "5-1", "5-2"]
    assert [r.name for r in resolve_modes(["6"])] == ["fp32", "6-0", "6-1"]
    names = [r.name for r in resolve_modes(["se"])]
    assert set(AS_WRITTEN) <= set(names) and "5-5" not in names
    with pytest.raises(ModeError, match="preset 'se' has no modes for a mamba2 model"):
        resolve_modes(["se"], architecture="mamba2")
    with pytest.raises(ModeError, match="mode '5-4' does not run on a mamba2 model: the Quamba-SE fork"):
        resolve_modes(["5-4"], architecture="mamba2")


def test_decode_and_generate_are_refused(tmp_path):
    for kw in ({"decode": 2}, {"generate": 2}):
        with pytest.raises(RunError, match="mode 5-4 is prefill/log-likelihood only"):
            run_modes(SHIPPED, tmp_path, ["fp32", "5-4"], seq_len=16, calib=CALIB, **kw)
    assert recipe_for(get_mode("0")).decode_problem(get_mode("0")) is None


def test_command_line_takes_the_modes_and_refuses_generation(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("QUAMBA_HARNESS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "c.npz"
    assert run_cli(capture_main, [*FAST_CLI, "--model", SHIPPED, "--modes", "5-4", "6-3", "--output_file", out]) == 0
    assert out.exists()
    assert run_cli(capture_main, [*FAST_CLI, "--model", SHIPPED, "--modes", "6", "--generate", "2",
                                  "--output_file", tmp_path / "g.npz"]) == 2
    assert "prefill/log-likelihood only" in capsys.readouterr().err


def test_segment_diagnostics_in_the_stats_compare_and_report(run, tmp_path):
    """Per mode and layer: each segment's fraction of u's elements and share of the squared error, which match the
    kernels on the run's own conv output; compare prints them and the report has the section."""
    from harness.store.schema import check_stats
    check_stats(run.stats, "stats")
    seg = run.stats["modes"]["5-7"]["layers"]["L0"]["se_segments"]["ssm.u"]
    assert set(seg) == {"high", "mid", "low"}
    assert sum(v["fraction"] for v in seg.values()) == pytest.approx(1.0)
    x_c = _t(run, "5-7", "conv1d.out")
    want = V.segment_shares(x_c, V.vq_three_segment(x_c, _s(run)))
    assert {k: pytest.approx(v["fraction"]) for k, v in want.items()} == {k: v["fraction"] for k, v in seg.items()}
    assert {k: pytest.approx(v["error_share"]) for k, v in want.items()} == {k: v["error_share"] for k, v in seg.items()}
    assert set(run.stats["modes"]["6-4"]["layers"]["L0"]["se_segments"]["ssm.u"]) == {"normal", "outlier"}
    assert "layers" not in run.stats["modes"]["0"]


def test_compare_and_report_show_the_segments(tmp_path, capsys, monkeypatch):
    from harness.cli import compare_main
    from harness.report.build import build_report
    monkeypatch.setenv("QUAMBA_HARNESS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "c.npz"
    assert run_cli(capture_main, [*FAST_CLI, "--model", SHIPPED, "--modes", "fp32", "5-6", "--output_file", out]) == 0
    capsys.readouterr()
    assert run_cli(compare_main, [out, "--reference", "fp32"]) == 0
    text = capsys.readouterr().out
    assert "Quamba-SE segments" in text and re.search(r"5-6\s+L0\.ssm\.u\s+log2\s+[\d.]+%\s+[\d.]+%", text), text
    html, _ = build_report(out, "fp32")
    assert 'id="se-segments"' in html and "log2" in html


def test_segments_summed_over_samples_in_workers_as_serial(tmp_path):
    """Two samples: the worker units' sums merge to the serial run's (counts cover every element of both)."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    serial = run_modes(SHIPPED, tmp_path / "a", ["fp32", "5-7"], seq_len=16, calib=CALIB, samples=2)
    units = run_modes(SHIPPED, tmp_path / "b", ["fp32", "5-7"], seq_len=16, calib=CALIB, samples=2, workers=2)
    seg = serial.stats["modes"]["5-7"]["layers"]
    assert seg == units.stats["modes"]["5-7"]["layers"]
    assert sum(v["count"] for v in seg["L0"]["se_segments"]["ssm.u"].values()) == 2 * 16 * 384


def test_striped_read_order_at_seqlen_128(tmp_path):
    """+striped: at L = 128 the scan gets u permuted as fwd_mode5's striped loader pairs it (kernels.vquant); the
    taps before the scan are the plain mode's."""
    out = run_modes(SHIPPED, tmp_path, ["fp32", "5-1", "5-1+striped"], seq_len=128, calib=CALIB,
                    taps=["conv1d.out", "ssm.u", "ssm.out"])
    plain, striped = _t(out, "5-1", "ssm.u"), _t(out, "5-1+striped", "ssm.u")
    assert torch.equal(_t(out, "5-1", "conv1d.out"), _t(out, "5-1+striped", "conv1d.out"))
    assert torch.equal(striped, V.striped_u(plain)) and not torch.equal(striped, plain)
    assert not torch.allclose(_t(out, "5-1", "ssm.out"), _t(out, "5-1+striped", "ssm.out"))


def test_6x_linear_paths(run):
    """6-1: x_proj is F.linear on fp32 u with the dequantized int8 weight (forward_mode6), dt/B/C fp32; 6-0: x_dbl and
    dt virtual int8 at s_xp, s_dt (RNE, exact division by the 0-dim scales); 6-4: dt back to int8 at s_dt."""
    from harness.runner.weightbank import WeightBank
    from harness.checkpoints.loading import open_checkpoint
    w = WeightBank(open_checkpoint(SHIPPED)).layer(0, "int8", True, "quamba").x_proj
    got = _t(run, "6-1", "x_proj.out")
    want = torch.nn.functional.linear(_t(run, "6-1", "x_proj.in"), w.dequantize())
    assert torch.equal(got, want)
    tensors = run.stats["modes"]
    s_xp, s_dt = (tensors["0"]["tensors"][f"L0.{t}"]["scale"] for t in ("x_proj.out", "dt_proj.out"))
    assert tensors["6-0"]["tensors"]["L0.x_proj.out"]["scale"] == s_xp
    assert tensors["6-0"]["tensors"]["L0.dt_proj.out"]["scale"] == s_dt
    assert tensors["6-4"]["tensors"]["L0.dt_proj.out"]["scale"] == s_dt
    assert "scale" not in tensors["6-4"]["tensors"]["L0.x_proj.out"] and "scale" not in tensors["6-1"]["tensors"]["L0.dt_proj.out"]


def test_a_modes_file_cannot_invent_an_se_mode(tmp_path):
    import json
    modes_file = tmp_path / "m.json"
    modes_file.write_text(json.dumps({"modes": {"my-se": {"base": "0", "conv_out": "fp32", "ssm_u": "fp32",
                                                          "family": "quamba-se"}}}))
    with pytest.raises(RunError, match="family quamba-se runs its own modes only"):
        run_modes(SHIPPED, tmp_path, ["fp32", "my-se"], seq_len=16, calib=CALIB, modes_file=modes_file)
