"""eval --ray: the units as Ray tasks (a local cluster started for the run) give the serial run's file."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("ray", reason="Ray (the optional [cluster] extra: pip install -e '.[cluster]') is not installed")

from helpers import run_cli  # noqa: E402

from harness.cli.evaluate import eval_main  # noqa: E402
from harness.lmeval.run import EvalConfig, run_eval  # noqa: E402
from harness.runner.calibration import CalibrationSettings  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _modes(doc: dict) -> dict:
    return {m: {k: v for k, v in e.items() if k != "seconds"} for m, e in doc["modes"].items()}


def test_ray_units_give_the_serial_runs_results(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    cfg = dict(model=ROOT / "models" / "mamba-tiny", modes=["fp32", "2-1"], tasks=["quamba_lastword"], limit=2,
               calib=CalibrationSettings(4, 32, batch_size=2), bootstrap_iters=200, max_length=64)
    serial = run_eval(EvalConfig(output=tmp_path / "serial", **cfg), emit=lambda _l: None)
    on_ray = run_eval(EvalConfig(output=tmp_path / "ray", ray="local", **cfg), emit=lambda _l: None)
    assert _modes(on_ray) == _modes(serial) and on_ray["paired"] == serial["paired"]
    assert all(e["status"] == "ok" for e in on_ray["modes"].values())


def test_an_unreachable_ray_address_is_exit_2_before_any_work(tmp_path, capsys):
    rc = run_cli(eval_main, ["--ray", "127.0.0.1:1", "--model", tmp_path / "no-model", "--output", tmp_path / "x"])
    err = capsys.readouterr().err  # refused before the (missing) model is opened
    assert rc == 2 and "--ray 127.0.0.1:1: cannot reach the Ray cluster" in err
