"""The command lines, run as a user runs them: in a subprocess, checking exit codes, output and files (the table of
bad inputs runs the script's entry in-process: one interpreter start per message cost seconds each)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, make_hf_model, write_hf_dir
from harness.cli import capture_main
from helpers import run_cli

FAST = ["--seq_len", "32", "--calib_data_num", "8", "--calib_seqlen", "32"]


def _run(args, tmp_path, script="save_first_layer_io.py", env=None):
    full_env = {**os.environ, "QUAMBA_HARNESS_CACHE": str(tmp_path / "cache"), **(env or {})}
    return subprocess.run([sys.executable, str(ROOT / script), *map(str, args)], capture_output=True, text=True,
                          cwd=tmp_path, env=full_env, timeout=600)


def test_capture_then_compare(hf_dir, tmp_path):
    r = _run(["--model", hf_dir, "--modes", "fp32", "0", "2-0", *FAST], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "MODE 0  (Quamba1 W8A8 baseline)" in r.stdout and "First 10 values" in r.stdout
    assert "bit-identical modes (every shared tensor equal bit for bit): 0 = 2-0" in r.stdout
    npz = tmp_path / "first_layer_io_all_modes.npz"
    with np.load(npz, allow_pickle=False) as z:
        assert z["mode_0_output"].shape == (1, 32, 24) and z["token_ids"].shape == (1, 32)
        assert int(z["seq_len"]) == 32 and str(z["model"]) == "tiny-hf"
    stats = json.loads((tmp_path / "first_layer_io_all_modes_stats.json").read_text())
    assert stats["schema_version"] == 3 and stats["modes"]["0"]["recipe"]["ssm_impl"] == "kernel"
    assert stats["provenance"]["calibration"]["source"] == "computed"

    c = _run([npz, "--json", tmp_path / "cmp.json"], tmp_path, script="compare_with_fp.py")
    assert c.returncode == 0, c.stderr
    assert "output vs fp32" in c.stdout and "SQNR dB" in c.stdout and "0 = 2-0" in c.stdout
    cmp = json.loads((tmp_path / "cmp.json").read_text())
    assert cmp["reference"] == "fp32"
    assert set(cmp["modes"]["0"]["output"]) >= {"mse", "mae", "rmse", "max_abs", "max_abs_index", "rel_l2",
                                                "sqnr_db", "cosine", "pearson", "p50", "p90", "p99"}

    fail = _run([npz, "--fail-if", "tensor == 'output' and sqnr_db < 1000"], tmp_path, script="compare_with_fp.py")
    assert fail.returncode == 1 and "0 output" in fail.stderr
    ok = _run([npz, "--fail-if", "sqnr_db < -1000"], tmp_path, script="compare_with_fp.py")
    assert ok.returncode == 0
    bad = _run([npz, "--fail-if", "__import__('os')"], tmp_path, script="compare_with_fp.py")
    assert bad.returncode == 2 and "is not allowed" in bad.stderr


def test_failing_mode_is_recorded_and_exit_code_is_1(tmp_path):
    # d_model 36 has no Hadamard transform: every rotated mode fails, mode 1 (no rotation) works
    model = write_hf_dir(tmp_path / "m36", make_hf_model(d_model=36, n_layer=1))
    r = _run(["--model", model, "--modes", "1", "fp32", *FAST], tmp_path)
    assert r.returncode == 1
    assert "mode fp32 failed" in r.stderr and "no Hadamard transform of size 36" in r.stderr
    stats = json.loads((tmp_path / "first_layer_io_all_modes_stats.json").read_text())
    assert stats["modes"]["fp32"]["status"] == "error" and "12*2^k" in stats["modes"]["fp32"]["error"]
    assert stats["modes"]["1"]["status"] == "ok" and stats["failed_modes"] == ["fp32"]
    with np.load(tmp_path / "first_layer_io_all_modes.npz") as z:
        assert "mode_1_output" in z and "mode_fp32_output" not in z


@pytest.mark.parametrize("args,message", [
    (["--modes", "fp32", "2-9"], "unknown mode '2-9'; valid: fp32, 1, 0, 2-0"),
    (["--seq_len", "0"], "argument --seq_len/--seq-len: must be a positive integer, got 0"),
    (["--seq_len", "-3"], "must be a positive integer"),
    (["--seq_len", "100000"], "tokens with this tokenizer, fewer than --seq_len 100000"),
    (["--percentile_alpha", "1.5"], "must be in (0, 1]"),
    (["--calib_data_num", "100000"], "--calib_data_num 100000 is too many"),
    (["--taps", "ssm.v"], "unknown tap 'ssm.v'"),
    (["--layers", "7"], "has 2 blocks (valid: 0..1,"),
    (["--output_file", "no/such/dir/out.npz"], "directory no/such/dir does not exist"),
])
def test_bad_input_exits_2_with_a_clear_message_and_no_files(hf_dir, tmp_path, monkeypatch, capsys, args, message):
    """In-process: the script's own entry (capture_main under its name) in the script's working directory, with the
    cache _run gives it; the script's exit 2 in a subprocess: test_missing_model_directory and
    test_resume_and_stats_only."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("QUAMBA_HARNESS_CACHE", str(tmp_path / "cache"))
    rc = run_cli(lambda argv: capture_main(argv, prog="save_first_layer_io.py"),
                 ["--model", hf_dir, "--modes", "fp32", "0", "--calib_seqlen", "32", *args])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert message in err and "Traceback" not in err
    assert not list(tmp_path.glob("*.npz")) and not list(tmp_path.glob("*.json"))


def test_missing_model_directory(tmp_path):
    r = _run(["--model", tmp_path / "nowhere"], tmp_path)
    assert r.returncode == 2
    assert "nowhere does not exist; a model directory must contain config.json" in r.stderr


def test_research_option_names(hf_dir, tmp_path):
    r = _run(["--pretrained_dir", hf_dir.parent, "--model", hf_dir.name, "--modes", "fp32", "1",
              "--output_file", "custom.npz", "--mamba_model_path", "x", *FAST], tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "custom.npz").is_file() and (tmp_path / "custom_stats.json").is_file()
    assert "--mamba_model_path is ignored" in r.stderr


def test_same_command_gives_identical_files(hf_dir, tmp_path):
    args = ["--model", hf_dir, "--modes", "fp32", "0", "3", "--taps", "all", *FAST]
    env = {"SOURCE_DATE_EPOCH": "1700000000"}
    for name in ("a.npz", "b.npz"):
        assert _run([*args, "--output_file", name], tmp_path, env=env).returncode == 0
    assert (tmp_path / "a.npz").read_bytes() == (tmp_path / "b.npz").read_bytes()


def test_resume_and_stats_only(hf_dir, tmp_path):
    assert _run(["--model", hf_dir, "--modes", "fp32", "0", *FAST], tmp_path).returncode == 0
    r = _run(["--model", hf_dir, "--modes", "fp32", "0", "2-1", "--resume", *FAST], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "mode 0: kept from" in r.stdout
    stats = json.loads((tmp_path / "first_layer_io_all_modes_stats.json").read_text())
    assert stats["modes"]["0"].get("resumed") and "resumed" not in stats["modes"]["2-1"]
    with np.load(tmp_path / "first_layer_io_all_modes.npz") as z:
        assert {"mode_fp32_output", "mode_0_output", "mode_2-1_output"} <= set(z.files)
    other = _run(["--model", hf_dir, "--modes", "fp32", "--resume", "--seq_len", "16"], tmp_path)
    assert other.returncode == 2 and "different token ids" in other.stderr

    s = _run(["--model", hf_dir, "--modes", "fp32", "0", "--stats-only", "--output_file", "s.npz", *FAST], tmp_path)
    assert s.returncode == 0
    with np.load(tmp_path / "s.npz") as z:
        assert "mode_0_output" not in z and "token_ids" in z
    stats = json.loads((tmp_path / "s_stats.json").read_text())
    assert stats["comparison"]["modes"]["0"]["output"]["mse"] > 0
    c = _run([tmp_path / "s.npz"], tmp_path, script="compare_with_fp.py")
    assert c.returncode == 2 and "written with --stats-only" in c.stderr
    other_calib = _run(["--model", hf_dir, "--modes", "fp32", "0", "--resume", "--percentile_alpha", "0.99", *FAST], tmp_path)
    assert other_calib.returncode == 2 and "calibrated with other settings" in other_calib.stderr


def test_comparator_reads_research_files_and_rejects_corrupted_ones(tmp_path):
    ref = np.random.default_rng(0).standard_normal((1, 8, 16)).astype(np.float32)
    np.savez_compressed(tmp_path / "old.npz", timestamp=np.array("t"), model=np.array("quamba-130m-w8a8"),
                        pretrained_dir=np.array("p"), seq_len=np.array(512), mode_fp32_input=ref, mode_fp32_output=ref,
                        **{"mode_2-1_input": ref, "mode_2-1_output": ref * 1.01})
    r = _run([tmp_path / "old.npz", "--json", tmp_path / "o.json"], tmp_path, script="compare_with_fp.py")
    assert r.returncode == 0, r.stderr
    assert "research-tool file, no manifest" in r.stdout
    out = json.loads((tmp_path / "o.json").read_text())
    assert out["modes"]["2-1"]["input"]["sqnr_db"] == float("inf")  # written as 1e999 (schema 3)
    assert out["modes"]["2-1"]["output"]["rel_l2"] == pytest.approx(0.01, rel=1e-4)
    assert out["modes"]["2-1"]["output"]["input_differs"] is False
    (tmp_path / "bad.npz").write_bytes(b"garbage")
    bad = _run([tmp_path / "bad.npz"], tmp_path, script="compare_with_fp.py")
    assert bad.returncode == 2 and "not a readable .npz" in bad.stderr
    missing_ref = _run([tmp_path / "old.npz", "--reference", "0"], tmp_path, script="compare_with_fp.py")
    assert missing_ref.returncode == 2 and "reference mode '0' is not in the file" in missing_ref.stderr


def test_shell_wrapper_presets_and_lists(hf_dir, tmp_path):
    env = {**os.environ, "QUAMBA_HARNESS_CACHE": str(tmp_path / "cache"), "PYTHON": sys.executable,
           "MODEL": str(hf_dir), "OUTPUT_FILE": str(tmp_path / "w.npz"), "SEQ_LEN": "32"}
    r = subprocess.run(["bash", str(ROOT / "capture_first_layer.sh"), "fp32", "2-4", "--", "--calib_data_num", "8",
                        "--calib_seqlen", "32"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "modes: fp32 2-4" in r.stdout
    with np.load(tmp_path / "w.npz") as z:
        assert {"mode_fp32_output", "mode_2-4_output"} <= set(z.files) and "mode_0_output" not in z.files
    u = subprocess.run(["bash", str(ROOT / "capture_first_layer.sh"), "quant_only", "--", "--modes_file", "nope.json"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert u.returncode == 2 and "cannot read modes file nope.json" in u.stderr


def test_without_the_reference_mode_both_messages_suggest_one_in_the_file(hf_dir, tmp_path):
    """quant_only-like modes and the default reference fp32: the capture warns, compare refuses, and both name
    the --reference that works (a mode of the file)."""
    r = _run(["--model", hf_dir, "--modes", "0", "2-4", "--output_file", tmp_path / "q.npz", "--quiet", *FAST],
             tmp_path)
    assert r.returncode == 0, r.stderr
    assert "no comparison: reference mode 'fp32' was not run or failed" in r.stderr
    assert f"python -m harness compare {tmp_path / 'q.npz'} --reference 0" in r.stderr
    c = _run([tmp_path / "q.npz"], tmp_path, script="compare_with_fp.py")
    assert c.returncode == 2 and "reference mode 'fp32' is not in the file; modes present: 0, 2-4" in c.stderr
    assert "--reference 0" in c.stderr
    assert _run([tmp_path / "q.npz", "--reference", "0"], tmp_path, script="compare_with_fp.py").returncode == 0


@pytest.mark.parametrize("args", [["--help"], ["-h"], ["essential", "--help"]])
def test_shell_wrapper_help_prints_its_own_usage(tmp_path, args):
    env = {**os.environ, "PYTHON": sys.executable, "MODEL": str(tmp_path / "nowhere"),
           "OUTPUT_FILE": str(tmp_path / "w.npz")}
    r = subprocess.run(["bash", str(ROOT / "capture_first_layer.sh"), *args], capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.startswith("usage: ./capture_first_layer.sh [MODE|PRESET ...] [-- OPTION ...]")
    assert "essential = fp32 0 2-1 2-2 2-4" in r.stdout and "quant_only = 0 2-0" in r.stdout   # the presets
    assert "passed to save_first_layer_io.py" in r.stdout and "modes:" not in r.stdout       # no capture ran
    assert list(tmp_path.iterdir()) == []


def test_shell_wrapper_refuses_an_option_before_the_separator(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUTPUT_FILE": str(tmp_path / "w.npz")}
    r = subprocess.run(["bash", str(ROOT / "capture_first_layer.sh"), "essential", "--seq_len", "256"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and "option --seq_len must come after --" in r.stderr
    assert "./capture_first_layer.sh essential -- --seq_len" in r.stderr and list(tmp_path.iterdir()) == []


def test_python_m_harness(tmp_path):
    r = subprocess.run([sys.executable, "-m", "harness", "modes"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and "2-4" in r.stdout and "essential = fp32 0 2-1 2-2 2-4" in r.stdout
    # an unknown command's exit 2: tests/test_package.py::test_help_exits_0_and_lists_every_command (with its message)
