"""The mode loop forgets a calibration result (a W4 recipe's GPTQ weights, Quamba2's scales) once no mode still to
run reads it, so the last modes' peak memory does not hold the earlier modes' calibrations (issue 36)."""
from __future__ import annotations

import shutil

import pytest

from conftest import ROOT
from harness.recipes.registry import get_mode, recipe_for
from harness.runner import modeloop
from helpers import run_modes

from mamba2_fixtures import make_mamba2

MODES = ["fp32", "q2-w8a8", "q2-w4a8", "q2-w4a16"]


def _key(mode: str) -> str:
    recipe = get_mode(mode)
    return recipe_for(recipe).calibration_key(recipe)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("calib_release") / "model"
    make_mamba2(d, ngroups=1, layers=2, vocab=4096, chunk=8, tie=True, seed=5)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(ROOT / "models" / "mamba-tiny" / name, d / name)
    return d


def _held_per_mode(model_dir, out, monkeypatch, modes: list[str], **kw) -> tuple[dict[str, set], object]:
    held: dict[str, set] = {}
    original = modeloop._forward

    def spy(ctx, recipe, wanted):
        held[recipe.name] = set(ctx.calibs)
        return original(ctx, recipe, wanted)
    monkeypatch.setattr(modeloop, "_forward", spy)
    result = run_modes(model_dir, out, modes, layers=["all"], seq_len=16, **kw)
    assert not result.failed, result.failed
    return held, result


def test_a_calibration_no_later_mode_reads_is_forgotten(model_dir, tmp_path, monkeypatch):
    keys = {m: _key(m) for m in MODES[1:]}
    assert len(set(keys.values())) == 3  # q2-w8a8's scales, and each W4 recipe's GPTQ weights
    held, result = _held_per_mode(model_dir, tmp_path, monkeypatch, MODES)
    assert held["fp32"] == held["q2-w8a8"] == set(keys.values())
    assert held["q2-w4a8"] == {keys["q2-w4a8"], keys["q2-w4a16"]}  # q2-w8a8's scales are gone
    assert held["q2-w4a16"] == {keys["q2-w4a16"]}
    assert set(result.stats["provenance"]["calibration_by_prep"]) == set(keys.values())  # still on record


def test_sensitivity_keeps_every_calibration(model_dir, tmp_path, monkeypatch):
    """The sensitivity study rebuilds every mode after the loop: it needs every calibration (mode 1 reads none;
    without --sensitivity q2-w8a8's scales would be gone when it runs)."""
    modes = ["fp32", "q2-w8a8", "1"]
    held, result = _held_per_mode(model_dir, tmp_path, monkeypatch, modes, end_to_end=True, sensitivity=True)
    assert held == {m: {_key("q2-w8a8")} for m in modes}
    assert set(result.stats["sensitivity"]) == {"q2-w8a8", "1"}
