"""The Python API as the README shows it: the command line's calibration cache by default, the long phases
on stderr, and no lock file left when a run is interrupted (issue "What trying it found", item 2)."""
import re
import shutil

import pytest

from conftest import TOKENIZER, make_hf_model, write_hf_dir
from harness import RunConfig, run
from harness.cli import capture_main
from harness.runner import pipeline
from harness.runner.calibration import default_cache_dir
from harness.runtime.guard import Progress
from helpers import FAST_CALIB, FAST_CLI, run_cli


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_hf_dir(tmp_path_factory.mktemp("m") / "m", make_hf_model(d_model=16, n_layer=2, d_state=4, seed=1))


def test_run_config_caches_calibration_where_the_command_line_does(tmp_path, monkeypatch):
    monkeypatch.setenv("QUAMBA_HARNESS_CACHE", str(tmp_path / "cache"))
    assert RunConfig().cache_dir == default_cache_dir() == tmp_path / "cache"
    assert RunConfig(cache_dir=None).cache_dir is None  # an explicit None: no cache


def test_run_from_python_reuses_the_default_cache_and_shows_phases(model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("QUAMBA_HARNESS_CACHE", str(tmp_path / "cache"))
    cfg = dict(model=model_dir, modes=["fp32", "0"], seq_len=16, calib=FAST_CALIB)
    first = run(RunConfig(**cfg, output_file=tmp_path / "a.npz"), emit=lambda _s: None)
    err = capsys.readouterr().err
    assert re.search(r"^calibrating \(prep=quamba, 16 x 64 tokens, layers 0\.\.0\) \.\.\. \(2 batches, estimated",
                     err, re.M)
    assert re.search(r"^mode 0: done in ", err, re.M)
    assert first.stats["provenance"]["calibration"]["source"] == "computed"
    assert list((tmp_path / "cache").glob("calib-*.npz"))
    second = run(RunConfig(**cfg, output_file=tmp_path / "b.npz"), emit=lambda _s: None)
    assert second.stats["provenance"]["calibration"]["source"] == "reused"
    run(RunConfig(**cfg, output_file=tmp_path / "c.npz"), emit=lambda _s: None, progress=Progress())
    assert capsys.readouterr().err.count("calibrating") == 0  # a caller's own Progress: silent


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_run_leaves_no_lock(model_dir, tmp_path, monkeypatch, exc):
    def stop(*_a, **_k):
        assert (tmp_path / "x.npz.lock").exists()  # held while the run works
        raise exc("stopped")

    monkeypatch.setattr(pipeline, "_calibrate", stop)
    with pytest.raises(exc):
        run(RunConfig(model=model_dir, modes=["fp32", "0"], seq_len=16, calib=FAST_CALIB, cache_dir=None,
                      output_file=tmp_path / "x.npz"), emit=lambda _s: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_mamba2_calibration_shows_an_estimate(tmp_path, capsys):
    from mamba2_fixtures import make_mamba2
    path = tmp_path / "m2"
    make_mamba2(path, vocab=4096, layers=2, seed=3)
    shutil.copy(TOKENIZER, path / "tokenizer.json")
    assert run_cli(capture_main,
                   [*FAST_CLI, "--model", path, "--modes", "fp32", "q2-w8a8", "--no_cache",
                    "--output_file", tmp_path / "c.npz"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"^calibrating \(prep=quamba2, 4 x 16 tokens, layers 0\.\.0, two passes\) \.\.\. "
                     r"\(4 batches, estimated \d+\.\d s\)$", err, re.M), err
