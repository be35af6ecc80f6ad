"""A run from the cache records what the same run computed fresh recorded (issue 35: a freshly calibrated run
recorded calibration_by_prep.quamba.observers and the same run from the cache did not). Every recipe's cache is
warmed by one run (runner.layercache entries of every kind) and read by a second: the two stats files are equal
but for where each result came from ("source", lm_head's too), how long it took ("seconds") and the cache files."""
from __future__ import annotations

import json

import pytest

from conftest import ROOT, make_hf_model, write_hf_dir
from harness.cli import capture_main
from harness.store.format import stats_path
from helpers import run_cli

TINY2 = ROOT / "models" / "mamba2-tiny"
_SOURCE_FIELDS = {"source", "lm_head_input_scale_source", "seconds", "cache_files"}
_RUN_FIELDS = {"timestamp", "npz"}  # when it ran, and the .npz file it wrote (its name and digest)


def _without(stats, fields: set[str]):
    if isinstance(stats, dict):
        return {k: _without(v, fields) for k, v in stats.items() if k not in fields}
    if isinstance(stats, list):
        return [_without(v, fields) for v in stats]
    return stats


def _sources(by_prep: dict) -> dict:
    return {prep: (info["source"], info.get("lm_head_input_scale_source")) for prep, info in by_prep.items()}


def _cold_and_warm(model, modes, tmp_path, monkeypatch, extra=()):
    """The stats of a run with an empty cache and of the same run again (QUAMBA_HARNESS_CACHE in tmp_path)."""
    monkeypatch.setenv("QUAMBA_HARNESS_CACHE", str(tmp_path / "cache"))
    (tmp_path / "m.json").write_text(json.dumps({"modes": {"q2-eval": {"base": "q2-w8a8", "lm_head": "quantized"}}}))
    args = ["--model", model, "--modes", *modes, "--modes_file", tmp_path / "m.json", "--layers", "all",
            "--seq_len", "16", "--calib_data_num", "4", "--calib_seqlen", "32", "--calib_batch_size", "2",
            "--stats_only", "--quiet", *extra]
    stats = []
    for name in ("cold", "warm"):
        assert run_cli(capture_main, [*args, "--output_file", tmp_path / f"{name}.npz"]) == 0
        stats.append(json.loads(stats_path(tmp_path / f"{name}.npz").read_text()))
    return stats


def test_a_warm_mamba1_run_records_what_the_cold_run_did(tmp_path, monkeypatch):
    """Quamba1's calibration (with its observers' state) and GPTQ of a Mamba-1 model (d_model 128: one group)."""
    model = write_hf_dir(tmp_path / "m", make_hf_model(d_model=128, n_layer=2, seed=11))
    cold, warm = _cold_and_warm(model, ["fp32", "0", "q2-w4a8", "q2-w4a16"], tmp_path, monkeypatch)
    by_prep = cold["provenance"]["calibration_by_prep"]
    assert _sources(by_prep) == {"quamba": ("computed", None), "quamba2-w4a8": ("computed", None),
                                 "quamba2-w4a16": ("computed", None)}
    assert _sources(warm["provenance"]["calibration_by_prep"]) == \
        {"quamba": ("reused", None), "quamba2-w4a8": ("reused", None), "quamba2-w4a16": ("reused", None)}
    observers = warm["provenance"]["calibration_by_prep"]["quamba"]["observers"]
    assert observers == by_prep["quamba"]["observers"] and len(observers) == 2 and observers[1]["s_u"]["samples"] == 4
    assert _without(warm, _SOURCE_FIELDS | _RUN_FIELDS) == _without(cold, _SOURCE_FIELDS | _RUN_FIELDS)
    files = sorted(p.name.split("-")[0] for p in (tmp_path / "cache").iterdir())
    assert files == ["calib"] * 2 + ["gptq"] * 4  # one entry per layer; nothing else is left in the cache


def test_a_warm_mamba2_run_records_what_the_cold_run_did(tmp_path, monkeypatch):
    """Quamba2's calibration, lm_head's input scale (a quantized lm_head, end to end) and GPTQ of a Mamba-2 model."""
    cold, warm = _cold_and_warm(TINY2, ["fp32", "q2-w8a8", "q2-eval", "q2-w4a8", "q2-w4a16"], tmp_path,
                                monkeypatch, ["--end-to-end"])
    assert _sources(cold["provenance"]["calibration_by_prep"]) == \
        {"quamba2": ("computed", "computed"), "quamba2-w4a8": ("computed", None), "quamba2-w4a16": ("computed", None)}
    assert _sources(warm["provenance"]["calibration_by_prep"]) == \
        {"quamba2": ("reused", "reused"), "quamba2-w4a8": ("reused", None), "quamba2-w4a16": ("reused", None)}
    assert _without(warm, _SOURCE_FIELDS | _RUN_FIELDS) == _without(cold, _SOURCE_FIELDS | _RUN_FIELDS)
    assert cold["end_to_end"]["q2-eval"]["kl"] == warm["end_to_end"]["q2-eval"]["kl"]
    kinds = sorted(p.name.rsplit("-", 1)[0] for p in (tmp_path / "cache").iterdir())
    assert kinds == ["calib-q2"] * 3 + ["calib-q2-head"] + ["gptq"] * 6  # 3 blocks


@pytest.mark.parametrize("fields", [{"observers"}, {"layers"}])
def test_the_comparison_sees_a_missing_record(fields):
    """The comparison above is not vacuous: a record that a warm run would drop is a difference."""
    cold = {"provenance": {"calibration_by_prep": {"quamba": {"source": "computed", "observers": [1], "layers": [2]}}}}
    assert _without(_without(cold, fields), _SOURCE_FIELDS) != _without(cold, _SOURCE_FIELDS)
