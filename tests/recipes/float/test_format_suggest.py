"""--suggest: the choice of per-layer formats from per-block KLs, and the whole study on the shipped tiny model."""
import json

import pytest

from harness.cli import main
from harness.modes import load_modes_file
from harness.runner.suggest import choose, suggest
from helpers import run_cli

KL = {  # format -> block -> KL of that block alone in it; block 1 is the sensitive one
    "bf16": {0: 0.0, 1: 0.0, 2: 0.0},
    "mxfp8_e4m3": {0: 0.001, 1: 0.02, 2: 0.001},
    "mxfp4_e2m1": {0: 0.01, 1: 0.5, 2: 0.012},
}


def test_choose_spends_the_budget_on_the_insensitive_blocks_first():
    assert choose(KL, 0.0) == {0: "bf16", 1: "bf16", 2: "bf16"}
    assert choose(KL, 0.025) == {0: "mxfp4_e2m1", 1: "bf16", 2: "mxfp4_e2m1"}
    assert choose(KL, 0.05) == {0: "mxfp4_e2m1", 1: "mxfp8_e4m3", 2: "mxfp4_e2m1"}
    assert choose(KL, 10.0) == {0: "mxfp4_e2m1", 1: "mxfp4_e2m1", 2: "mxfp4_e2m1"}


def test_choose_never_exceeds_the_budget_by_its_own_sum():
    for budget in (0.0, 0.003, 0.011, 0.03, 0.2, 0.6):
        pick = choose(KL, budget)
        assert sum(KL[f][i] for i, f in pick.items()) <= budget


@pytest.fixture(scope="module")
def study():
    return suggest(None, ["bf16", "mxfp4_e2m1"], 0.02, seq_len=32)


def test_suggest_on_the_tiny_model_follows_its_study(study):
    kl = {f: {int(i): v for i, v in d.items()} for f, d in study["kl_by_format"].items()}
    assert study["assignment"] == {str(i): f for i, f in choose(kl, 0.02).items()}
    # a budget just short of every block in mxfp4: the block mxfp4 hurts most is the one kept in bf16
    fp4 = kl["mxfp4_e2m1"]
    most = max(fp4, key=fp4.get)
    pick = choose(kl, sum(fp4.values()) - fp4[most] / 2)
    assert pick[most] == "bf16" and all(f == "mxfp4_e2m1" for i, f in pick.items() if i != most)
    assert study["verified_kl"] >= 0 and study["within_budget"] == (study["verified_kl"] <= 0.02)


def test_suggest_cli_writes_a_modes_file_the_harness_reads(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert run_cli(main, ["formats", "--suggest", "100", "--formats", "bf16", "mxfp4_e2m1", "--seq_len", "16",
                          "--output", out]) == 0
    (recipe,) = load_modes_file(out)
    assert recipe.name == "suggested" and {dict(kv)["act_format"] for _, kv in recipe.layers} == {"mxfp4_e2m1"}
    assert "verified end-to-end KL" in capsys.readouterr().out
    assert run_cli(main, ["formats", "--suggest", "1", "--formats", "fp7"]) == 2
    assert json.loads(out.read_text())["modes"]["suggested"]["base"] == "fp32"
