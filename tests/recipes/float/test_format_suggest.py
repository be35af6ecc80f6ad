"""--suggest: the choice of per-layer formats from per-block KLs, and the whole study on the shipped tiny model."""
import json
import shutil

import pytest

from conftest import ROOT, SHIPPED
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
    out = _previous(tmp_path / "s.json")  # a previous suggestion is replaced
    assert run_cli(main, ["formats", "--suggest", "100", "--formats", "bf16", "mxfp4_e2m1", "--seq_len", "16",
                          "--output", out]) == 0
    (recipe,) = load_modes_file(out)
    assert recipe.name == "suggested" and {dict(kv)["act_format"] for _, kv in recipe.layers} == {"mxfp4_e2m1"}
    assert "verified end-to-end KL" in capsys.readouterr().out
    assert run_cli(main, ["formats", "--suggest", "1", "--formats", "fp7"]) == 2
    assert json.loads(out.read_text())["modes"]["suggested"]["base"] == "fp32"


def _previous(path):
    """A previous suggestion: the modes file --suggest writes."""
    path.write_text(json.dumps({"modes": {"suggested": {"base": "fp32", "title": "suggested per-layer formats",
                                                        "layers": {"0": {"weight_format": "bf16"}}}}}))
    return path


@pytest.fixture()
def model_copy(tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(SHIPPED, dst)
    return dst


SUGGEST_ERRORS = [  # (name, extra argv, what stderr names); {m} the model copy, {t} the test's directory
    ("missing-model", ["--model", "{t}/nowhere"], "nowhere does not exist; a model directory must contain"),
    ("seq-len-too-long", ["--seq_len", "10000000"], "fewer than --seq_len 10000000"),
    ("seq-len-zero", ["--seq_len", "0"], "--seq_len must be a positive integer, got 0"),
    ("negative-budget", ["--suggest", "-1"], "--suggest needs a finite KL budget >= 0"),
    ("output-directory", ["--output", "{t}"], "it is a directory, not a regular file"),
    ("output-dev-null", ["--output", "/dev/null"], "it is a character device"),
    ("output-missing-dir", ["--output", "{t}/no/dir/s.json"], "no/dir does not exist"),
    ("output-model-config", ["--model", "{m}", "--output", "{m}/config.json"],
     "it is a file of the model directory"),
    ("output-model-weights", ["--model", "{m}", "--output", "{m}/model.safetensors"],
     "it is a file of the model directory"),
    ("output-own-modes-file", ["--output", "{t}/mine.json"], "not a previous suggestion, so it is left alone"),
    ("a-capture-file", ["{t}/x.npz"], "--suggest takes no capture FILE"),
]


@pytest.mark.parametrize("name,extra,fragment", SUGGEST_ERRORS, ids=[c[0] for c in SUGGEST_ERRORS])
def test_every_suggest_error_is_exit_2_with_its_message_and_nothing_written(name, extra, fragment, tmp_path,
                                                                          model_copy, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.json").write_text('{"modes": {"mine": {"base": "fp32"}}}')
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    argv = [str(a).format(t=tmp_path, m=model_copy) for a in
            ["formats", "--suggest", "0.05", "--formats", "bf16", "--seq_len", "16", *extra]]
    assert run_cli(main, argv) == 2
    out, err = capsys.readouterr()
    assert fragment in err and err.startswith("error: ") and "Traceback" not in err, err
    if name.startswith("output"):  # the path is checked before the 60-second study starts
        assert "sensitivity of" not in out
    assert {p: p.read_bytes() for p in before} == before
    assert not (tmp_path / "suggested_modes.json").exists()


def test_the_runs_text_and_calibration_files_are_refused_as_output():
    """Checked without the command (which, unfixed, would replace the repository's text file)."""
    from harness.runner.config import RunConfig
    from harness.runner.suggest import check_suggestion_output
    from harness.store.files import StorageError

    for path, what in ((RunConfig().text_file, "the text file"), (RunConfig().calib_file, "the calibration file")):
        with pytest.raises(StorageError, match=f"it is {what} of the run .* so it is left alone"):
            check_suggestion_output(path)


def test_formats_help_lists_the_suggest_options(capsys):
    assert run_cli(main, ["formats", "--help"]) == 0
    text = capsys.readouterr().out
    for option in ("--suggest BUDGET", "--model", "--seq_len", "--output", "--formats", "--json"):
        assert option in text
    assert run_cli(main, ["formats", "--model", "x"]) == 2
    assert "--model only apply with --suggest BUDGET" in capsys.readouterr().err
