"""prep in whole runs: one calibration per prep under its own cache key, the stats, the Hadamard width warning."""
import hashlib
import json
from dataclasses import asdict

import numpy as np
import pytest
import torch

from conftest import make_hf_model, write_hf_dir
from harness.runner.calibration import layer_keys
from helpers import FAST_CALIB, run_modes


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # d_model 48 = 12 * 4 (Quamba's 12N kernel, log_N 2); d_inner 96 = 12 * 8 (log_N 3: never launched)
    return write_hf_dir(tmp_path_factory.mktemp("q") / "m48", make_hf_model(d_model=48, n_layer=1, d_state=16, seed=4))


@pytest.fixture(scope="module")
def mixed(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("mixed")
    modes_file = out / "modes.json"
    modes_file.write_text(json.dumps({"modes": {"0x": {"base": "0", "prep": "exact"}}}))
    first = run_modes(model_dir, out, ["0", "0x", "fp32"], taps=["all"], modes_file=modes_file)
    second = run_modes(model_dir, out, ["0", "0x", "fp32"], taps=["all"], modes_file=modes_file)
    return first, second


def test_one_calibration_per_prep_each_cached_under_its_own_key(mixed):
    first, second = mixed
    by_prep = first.stats["provenance"]["calibration_by_prep"]
    assert set(by_prep) == {"quamba", "exact"}
    assert {p: i["source"] for p, i in by_prep.items()} == {"quamba": "computed", "exact": "computed"}
    assert by_prep["quamba"]["keys"] != by_prep["exact"]["keys"]
    assert first.stats["provenance"]["calibration"]["prep"] == "quamba"  # the first mode's prep
    again = second.stats["provenance"]["calibration_by_prep"]
    assert {p: i["source"] for p, i in again.items()} == {"quamba": "reused", "exact": "reused"}
    assert first.stats["modes"]["0"]["recipe"]["prep"] == "quamba"
    assert first.stats["modes"]["0x"]["recipe"]["prep"] == "exact"


def test_caches_of_before_the_prep_knob_are_never_reused():
    """Version 1 keys hashed {version, settings, tokens} without a prep: no key of today equals them."""
    windows = torch.arange(64).reshape(2, 32)
    tokens = hashlib.sha256(windows.numpy().tobytes()).hexdigest()
    old_common = json.dumps({"version": 1, "settings": asdict(FAST_CALIB), "tokens": tokens}, sort_keys=True)
    old = hashlib.sha256(f"{old_common}|h0".encode()).hexdigest()
    new = {p: layer_keys(["h0"], windows, FAST_CALIB, p)[0] for p in ("quamba", "exact")}
    assert old not in new.values() and new["quamba"] != new["exact"]


def test_quamba_preparation_moves_in_proj_codes(mixed):
    """The issue's headline: Quamba's fp16 fold and kernel rotation change some in_proj int8 codes."""
    a, b = (mixed[0].by_mode[m] for m in ("0", "0x"))
    s_q = mixed[0].stats["modes"]["0"]["tensors"]["L0.in_proj.out"]["scale"]
    s_x = mixed[0].stats["modes"]["0x"]["tensors"]["L0.in_proj.out"]["scale"]
    codes_q, codes_x = np.round(a["L0.in_proj.out"] / s_q), np.round(b["L0.in_proj.out"] / s_x)
    assert 0 < np.mean(codes_q != codes_x) < 0.5
    assert not np.array_equal(a["output"], b["output"])


def test_unsupported_hadamard_width_warns_once_and_is_recorded(model_dir, tmp_path, capsys):
    outcome = run_modes(model_dir, tmp_path, ["fp32", "0"], cache=False)
    err = capsys.readouterr().err
    assert err.count("Quamba's Hadamard kernels do not support") == 1 and "d_inner = 96" in err
    support = outcome.stats["provenance"]["hadamard_kernel_support"]
    assert support["d_model"] is None and "log_N = 3" in support["d_inner"]
    assert outcome.failed == []  # the harness still rotates it
    unrotated = run_modes(model_dir, tmp_path, ["1"], cache=False)  # mode 1 uses no Hadamard kernel
    assert "Hadamard" not in capsys.readouterr().err
    assert "hadamard_kernel_support" not in unrotated.stats["provenance"]


def test_resume_runs_again_a_mode_recorded_with_other_knobs(model_dir, tmp_path):
    """A file written before `prep` existed holds mode 0 as prep=exact computed it: --resume must not keep it."""
    run_modes(model_dir, tmp_path, ["fp32", "0"])
    stats_file = tmp_path / "capture_stats.json"
    stats = json.loads(stats_file.read_text())
    del stats["modes"]["0"]["recipe"]["prep"]
    stats_file.write_text(json.dumps(stats))
    again = run_modes(model_dir, tmp_path, ["fp32", "0"], resume=True)
    assert again.stats["modes"]["fp32"].get("resumed") and "resumed" not in again.stats["modes"]["0"]
    assert again.stats["modes"]["0"]["recipe"]["prep"] == "quamba"
