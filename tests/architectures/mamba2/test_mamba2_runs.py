"""Mamba-2 through the whole run (`all`: fp32, 1 and q2-w8a8): every layer and tap, isolated, end to end, several samples, sensitivity,
the HTML report, the `points` command, and Mamba-1-only modes refused with exit 2."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from conftest import ROOT
from harness.cli import capture_main, main
from harness.emulation.capture import MAMBA2_POINTS
from harness.report.data import load_report_data
from helpers import FAST_CLI, run_cli, run_modes

from mamba2_fixtures import make_mamba2

SEQ = 24  # chunk_size 8: three chunks per sample


@pytest.fixture(scope="module")
def m2(tmp_path_factory):
    d = tmp_path_factory.mktemp("m2run") / "model"
    hf = make_mamba2(d, ngroups=2, layers=2, vocab=4096, chunk=8, tie=False, seed=4)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(ROOT / "models" / "mamba-tiny" / name, d / name)
    return hf, d


@pytest.fixture(scope="module")
def run(m2, tmp_path_factory):
    _, d = m2
    out = tmp_path_factory.mktemp("m2out")
    result = run_modes(d, out, ["all"], layers=["all"], taps=["all"], seq_len=SEQ, samples=2, isolated=True,
                       end_to_end=True, sensitivity=True)
    result.path = out / "capture.npz"
    return result


def test_all_on_mamba2_runs_its_modes_with_every_point(run):
    assert list(run.by_mode) == ["fp32", "1", "q2-w8a8", "q2-w4a8", "q2-w4a16"] and not run.failed  # `all` on Mamba-2
    fp = run.by_mode["fp32"]
    for layer in (0, 1):
        for p in MAMBA2_POINTS:
            if p in ("block.in", "block.out", "block.residual") and layer == 0:
                continue  # layer 0's block I/O keep the research tool's names
            assert f"L{layer}.{p}" in fp, (layer, p)
        assert fp[f"L{layer}.ssd.state"].shape == (2, 1, 8, 8, 8)  # samples, batch, nheads, headdim, d_state
    assert "L0.had.out" not in run.by_mode["1"]  # mode 1 does not rotate
    assert run.stats["provenance"]["model"]["architecture"] == "mamba2"


def test_logits_equal_transformers_and_isolated_is_the_reference(run, m2):
    hf, _ = m2
    logits = run.by_mode["fp32"]["logits"]
    with torch.no_grad():
        ref = hf(input_ids=torch.as_tensor(run.token_ids)).logits.double().numpy()
    assert np.linalg.norm(logits[:, 0] - ref) / np.linalg.norm(ref) <= 1e-5  # untied lm_head used
    fp = run.by_mode["fp32"]
    assert np.array_equal(fp["L0.block.isolated"], fp["output"])
    assert np.array_equal(fp["L1.block.isolated"], fp["L1.block.out"])
    e2e = run.stats["end_to_end"]
    assert e2e["fp32"]["kl"]["mean"] == 0 and 0 < e2e["1"]["kl"]["mean"] < 1e-3
    sens = run.stats["sensitivity"]
    assert set(sens) == {"1", "q2-w8a8", "q2-w4a8", "q2-w4a16"} and all(set(sens[m]) == {"0", "1"} for m in sens)
    assert all(r["kl"] > 0 for m in sens for r in sens[m].values())
    assert e2e["q2-w8a8"]["kl"]["mean"] > e2e["1"]["kl"]["mean"]  # int8 costs more than fp16
    data = load_report_data(run.path)  # what the HTML report reads
    assert {r["layer"] for r in data.sensitivity()["1"]} == {0, 1} and data.samples()["count"] == 2


def test_points_command_lists_the_mamba2_sites(m2, capsys):
    _, d = m2
    assert main(["points", "--model", str(d)]) == 0
    listed = capsys.readouterr().out
    assert "L<i>.ssd.state" in listed and "L<i>.gnorm.out" in listed and "L<i>.ssm.u" not in listed
    assert main(["points", "--architecture", "mamba2"]) == 0
    assert capsys.readouterr().out == listed
    assert main(["points"]) == 0 and "L<i>.ssm.u" in capsys.readouterr().out  # Mamba-1 by default


def test_mamba1_only_mode_is_exit_2(m2, tmp_path, capsys):
    _, d = m2
    code = run_cli(capture_main, ["--model", d, "--modes", "fp32", "0", "--output_file", tmp_path / "x.npz", *FAST_CLI])
    assert code == 2
    err = capsys.readouterr().err
    assert "mode '0' does not run on a mamba2 model" in err and "valid there: fp32, 1" in err
    assert not list(tmp_path.iterdir())  # no partial file
    assert run_cli(capture_main, ["--model", d, "--modes", "fp32", "--taps", "ssm.u",
                                  "--output_file", tmp_path / "y.npz", *FAST_CLI]) == 2
    assert "ssm.u" in capsys.readouterr().err


def test_export_refuses_a_mamba2_w4_recipe(m2, tmp_path, capsys):
    """A Mamba-2 model exports as Quamba2 W8A8 (tests/recipes/quamba/q2/test_quamba2_export.py); its W4 recipes are not written."""
    from harness.cli import export_main
    _, d = m2
    assert run_cli(export_main, ["--model", d, "--output_dir", tmp_path / "q", "--recipe", "w4a16"]) == 2
    assert "Marlin" in capsys.readouterr().err and not (tmp_path / "q").exists()


def test_points_of_a_bad_model_directory_is_exit_2(tmp_path, capsys):
    assert main(["points", "--model", str(tmp_path / "none")]) == 2
    assert "does not exist" in capsys.readouterr().err
