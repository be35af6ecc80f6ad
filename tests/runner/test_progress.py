"""Issue 21 item 5: long phases show progress (stderr), a bar and an estimate on a terminal, --quiet silences it."""
import io
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import ROOT, SHIPPED
from harness.cli import capture_main, export_main
from harness.runner.calibcost import SECONDS_PER_TOKEN_CHANNEL, estimate_seconds
from harness.runtime.progress import PhaseDisplay, format_seconds
from helpers import FAST_CLI, run_cli

END = re.compile(r"^(.+): done in (\d+(\.\d)? s|\d+ min \d\d s|\d+ h \d\d min)$")


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _phases(err: str) -> tuple[list[str], list[str]]:
    """(phases started, phases ended) in the non-terminal lines of stderr."""
    lines = err.splitlines()
    started = [line[:-4] if line.endswith(" ...") else line.split(" ... (")[0] for line in lines if " ..." in line]
    ended = [m.group(1) for m in map(END.match, lines) if m]
    return started, ended


def test_terminal_line_is_redrawn_with_bar_and_time_left():
    clock, out = _Clock(), _Tty()
    d = PhaseDisplay(out, clock, interval=0.0)
    d.begin("calibrating", 4, "batches", estimate=30.0)
    assert out.getvalue() == "\r\x1b[Kcalibrating  [........................] 0/4 batches  0.0 s  about 30 s left"
    clock.t += 2.0
    d.advance()  # 1 of 4 in 2 s: 3 more take 6 s
    assert out.getvalue().endswith("\r\x1b[Kcalibrating  [######..................] 1/4 batches  2.0 s  "
                                   "about 6.0 s left")
    clock.t += 6.0
    d.advance(3)
    assert out.getvalue().endswith("[########################] 4/4 batches  8.0 s  about 0.0 s left")
    d.end()
    assert out.getvalue().endswith("\r\x1b[Kcalibrating: done in 8.0 s\n")
    assert "\n" not in out.getvalue()[:-1]  # one line, redrawn in place


def test_terminal_redraws_at_most_every_interval():
    clock, out = _Clock(), _Tty()
    d = PhaseDisplay(out, clock, interval=1.0)
    d.begin("mode 0", 100, "layers")
    for _ in range(10):
        clock.t += 0.05
        d.advance()
    assert out.getvalue().count("\r") == 1  # only the first draw: 0.5 s < 1 s
    clock.t += 0.6
    d.advance()
    assert out.getvalue().count("\r") == 2 and "11/100 layers" in out.getvalue()


def test_a_warning_on_a_terminal_starts_its_own_line_and_the_bar_comes_back(monkeypatch):
    from harness.runtime.log import warn

    clock, tty = _Clock(), _Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    d = PhaseDisplay(None, clock, interval=10.0)
    d.begin("mode 0", 2, "layers")
    warn("something")
    clock.t += 1.0
    d.advance()  # within the interval, but the line was wiped: drawn again
    assert tty.getvalue() == ("\r\x1b[Kmode 0  [........................] 0/2 layers  0.0 s"
                              "\r\x1b[Kwarning: something\n"
                              "\r\x1b[Kmode 0  [############............] 1/2 layers  1.0 s  about 1.0 s left")
    d.end()
    warn("after")  # no phase running: nothing to wipe
    assert tty.getvalue().endswith("\r\x1b[Kmode 0: done in 1.0 s\nwarning: after\n")


def test_not_a_terminal_one_line_at_start_one_at_end():
    clock, out = _Clock(), io.StringIO()
    d = PhaseDisplay(out, clock)
    d.begin("calibrating", 64, "batches", estimate=75.0)
    for _ in range(64):
        clock.t += 2.0
        d.advance()
    d.end()
    assert out.getvalue() == ("calibrating ... (64 batches, estimated 1 min 15 s)\n"
                              "calibrating: done in 2 min 08 s\n")
    d.begin("mode 0", 1, "layers")
    assert out.getvalue().endswith("\nmode 0 ... (1 layer)\n")


def test_a_line_of_its_own_goes_to_a_file_and_on_a_terminal_keeps_the_bar():
    out = io.StringIO()
    d = PhaseDisplay(out, _Clock())
    d.line("unit mode 0 sample 1 on w:1: 0.33 s (1/2; about 0 s left)")
    assert out.getvalue() == "unit mode 0 sample 1 on w:1: 0.33 s (1/2; about 0 s left)\n"
    clock, tty = _Clock(), _Tty()
    d = PhaseDisplay(tty, clock, interval=10.0)
    d.begin("mode 0", 2, "samples")
    d.line("unit mode 0 sample 0 on w:1: 0.10 s (1/2; about 0 s left)")
    assert tty.getvalue().endswith("\r\x1b[Kunit mode 0 sample 0 on w:1: 0.10 s (1/2; about 0 s left)\n")
    d.advance()  # within the interval, but the line was wiped: drawn again
    assert tty.getvalue().endswith("\r\x1b[Kmode 0  [############............] 1/2 samples  0.0 s  about 0.0 s left")


def test_format_seconds():
    assert [format_seconds(s) for s in (0.04, 9.94, 42.4, 125.0, 6300.0)] == \
        ["0.0 s", "9.9 s", "42 s", "2 min 05 s", "1 h 45 min"]


def test_calibration_estimate_is_tokens_layers_channels_times_the_measured_cost():
    dims = SimpleNamespace(d_inner=384, d_model=192, d_state=16)
    assert estimate_seconds(512 * 512, 3, dims) == 512 * 512 * 3 * 384 * SECONDS_PER_TOKEN_CHANNEL
    wide = SimpleNamespace(d_inner=1536, d_model=768, d_state=16)
    assert estimate_seconds(1000, 1, wide) == 4 * estimate_seconds(1000, 1, dims)


SMALL = [*FAST_CLI, "--modes", "fp32", "0", "--no_cache"]


def test_capture_shows_every_phase_on_stderr(tmp_path, capsys):
    out = tmp_path / "c.npz"
    assert run_cli(capture_main, [*SMALL, "--layers", "all", "--sensitivity", "--samples", "2",
                                  "--output_file", out]) == 0
    err = capsys.readouterr().err
    started, ended = _phases(err)
    want = ["reading the text", "calibrating (prep=quamba, 4 x 16 tokens, layers 0..2)", "mode fp32", "mode 0",
            "sensitivity of mode 0"]
    assert started == want and ended == want
    assert "mode 0 ... (3 layers)" in err and "sensitivity of mode 0 ... (6 forwards)" in err
    assert re.search(r"calibrating \(prep=quamba, 4 x 16 tokens, layers 0\.\.2\) \.\.\. \(2 batches, "
                     r"estimated \d+\.\d s\)", err)


@pytest.mark.parametrize("model", ["mamba-tiny", "mamba2-tiny"])
def test_the_gptq_phase_says_its_estimate(tmp_path, capsys, model):
    """GPTQ's phase (the W4 recipes' calibration) is announced with its size and an estimate (it had none)."""
    out = tmp_path / "c.npz"
    assert run_cli(capture_main, [*FAST_CLI, "--model", ROOT / "models" / model, "--modes", "q2-w4a16", "--no_cache",
                                  "--output_file", out]) == 0
    err = capsys.readouterr().err
    assert re.search(r"^GPTQ \(quamba2-w4a16, .*4 x 16 tokens, layers 0\.\.0\) \.\.\. \(1 layer, estimated "
                     r"\d+\.\d s\)$", err, re.M), err


def test_capture_quiet_prints_no_phase(tmp_path, capsys):
    out = tmp_path / "c.npz"
    assert run_cli(capture_main, [*SMALL, "--quiet", "--output_file", out]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == f"{out}\n"


def test_capture_on_a_terminal_draws_bars(tmp_path, capsys, monkeypatch):
    tty = _Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    assert run_cli(capture_main, [*SMALL, "--output_file", tmp_path / "c.npz"]) == 0
    text = tty.getvalue()
    assert "\r\x1b[Kmode fp32  [########################] 1/1 layers" in text
    assert "\r\x1b[Kcalibrating (prep=quamba, 4 x 16 tokens, layers 0..0)  [####" in text
    lines = text.split("\n")
    assert all(END.match(line.rsplit("\r\x1b[K", 1)[-1]) for line in lines[:-1])  # each phase ends its line
    assert " ... " not in text  # the start lines are for logs only


def test_export_shows_its_phases_and_quiet_silences_them(tmp_path, capsys):
    calib = ["--calib_data_num", "4", "--calib_seqlen", "16", "--calib_batch_size", "2", "--no_cache"]
    assert run_cli(export_main, ["--model", SHIPPED, "--output_dir", tmp_path / "q", *calib,
                                 "--quantize_lm_head"]) == 0
    started, ended = _phases(capsys.readouterr().err)
    want = ["reading the calibration text", "calibrating (prep=quamba, 4 x 16 tokens, layers 0..2)",
            "calibrating lm_head's input", "quantizing the weights"]
    assert started == want and ended == want
    assert run_cli(export_main, ["--model", SHIPPED, "--output_dir", tmp_path / "q2", *calib, "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == f"{tmp_path / 'q2'}\n"


def test_shell_wrapper_quiet_passes_through_and_prints_only_the_file(tmp_path):
    out = tmp_path / "w.npz"
    p = subprocess.run([str(ROOT / "capture_first_layer.sh"), "fp32", "--", *FAST_CLI, "--no_cache", "--quiet",
                        "--output_file", str(out)], capture_output=True, text=True, cwd=tmp_path,
                       env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
                            "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr
    assert p.stdout == f"{out}\n"
    assert _phases(p.stderr) == ([], [])
