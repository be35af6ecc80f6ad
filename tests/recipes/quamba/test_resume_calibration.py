"""--resume keeps the record of how kept modes were calibrated, so a later --resume with other calibration
settings is still refused (a run that calibrated nothing used to write a file without it)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from harness.runner.resume import ResumeError
from harness.store.format import stats_path
from helpers import FAST_CALIB, run_modes


def test_a_resume_that_calibrates_nothing_keeps_the_calibration_record(hf_dir, tmp_path):
    run_modes(hf_dir, tmp_path, ["fp32", "0"], seq_len=16)
    first = json.loads(stats_path(tmp_path / "capture.npz").read_text())["provenance"]["calibration"]
    assert first["settings"]["num_samples"] == FAST_CALIB.num_samples
    run_modes(hf_dir, tmp_path, ["fp32"], seq_len=16, resume=True)  # mode 0 kept: nothing is calibrated
    again = json.loads(stats_path(tmp_path / "capture.npz").read_text())
    assert again["modes"]["0"]["status"] == "ok" and again["modes"]["0"].get("resumed")
    kept = again["provenance"]["calibration"]
    assert kept["settings"] == first["settings"] and kept["source"] == "kept from the resumed file"
    assert again["provenance"]["calibration_by_prep"]["quamba"]["settings"] == first["settings"]
    with pytest.raises(ResumeError, match="calibrated with other settings"):
        run_modes(hf_dir, tmp_path, ["0"], seq_len=16, resume=True, calib=replace(FAST_CALIB, num_samples=8))
