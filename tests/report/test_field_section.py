"""The recipes side by side (harness.report.field_section) and the `field` preset."""
import json

import pytest

from harness.cli import compare_main
from harness.modes.knobs import MAMBA2_PRESETS, PRESETS
from harness.recipes.registry import resolve_modes
from harness.report.field_section import recipe_rows, recipe_table
from helpers import run_cli, run_modes


def _stats(modes, e2e=None):
    return {"modes": {m: {"recipe": {"family": f} if f else {"prep": "quamba"}} for m, f in modes.items()},
            "end_to_end": e2e}


def test_rows_rank_by_kl_when_every_mode_has_one_else_by_layer0_sqnr():
    comparison = {"modes": {"a": {"output": {"sqnr_db": 30.0}, "L0.block.isolated": {"sqnr_db": 31.0},
                                  "L1.block.isolated": {"sqnr_db": 29.0}},
                            "b": {"output": {"sqnr_db": 20.0}}, "0": {"output": {"sqnr_db": 25.0}}}}
    stats = _stats({"a": "naive", "b": "mambaquant", "0": ""},
                   {"a": {"kl": 0.3, "top1_agreement": 0.9}, "b": {"kl": 0.1, "top1_agreement": 0.95},
                    "0": {"kl": 0.2, "top1_agreement": 0.93}})
    rows = recipe_rows(comparison, stats)
    assert [(r["rank"], r["mode"], r["recipe"]) for r in rows] == [(1, "b", "mambaquant"), (2, "0", "quamba"),
                                                                   (3, "a", "naive")]
    assert rows[2]["isolated_sqnr_db_mean"] == pytest.approx(30.0) and rows[0]["isolated_sqnr_db_mean"] is None
    assert "ranked by end-to-end KL" in recipe_table(rows, "fp32")
    no_e2e = recipe_rows(comparison, _stats({"a": "naive", "b": "mambaquant", "0": ""}))
    assert [r["mode"] for r in no_e2e] == ["a", "0", "b"]
    assert "ranked by layer-0 output SQNR" in recipe_table(no_e2e, "fp32")


def test_rows_take_the_mean_of_a_measured_metric():
    """With --samples N the stats hold {"mean", "ci95"} for KL and top-1: the row ranks and prints the mean (the
    report's table raised a TypeError formatting the dict)."""
    comparison = {"modes": {"a": {"output": {"sqnr_db": 30.0}}, "b": {"output": {"sqnr_db": 20.0}}}}
    stats = _stats({"a": "naive", "b": "mambaquant"},
                   {"a": {"kl": {"mean": 0.3, "ci95": [0.2, 0.4]}, "top1_agreement": {"mean": 0.9, "ci95": [0.8, 1]}},
                    "b": {"kl": {"mean": 0.1, "ci95": [0.0, 0.2]}, "top1_agreement": {"mean": 0.95, "ci95": [0.9, 1]}}})
    rows = recipe_rows(comparison, stats)
    assert [(r["mode"], r["kl"], r["top1_agreement"]) for r in rows] == [("b", 0.1, 0.95), ("a", 0.3, 0.9)]
    assert "0.1" in recipe_table(rows, "fp32")


def test_field_preset_names_each_recipe_by_architecture():
    assert PRESETS["field"] == ("fp32", "0", "naive-static", "naive-dynamic", "smq-ssm", "mambaquant-w8a8",
                                "mambaquant-w8a8+quamba", "mambaquant-w4a8")
    assert [r.name for r in resolve_modes(["field"], architecture="mamba2")] == list(MAMBA2_PRESETS["field"])
    assert "q2-w8a8" in MAMBA2_PRESETS["field"] and "smq-ssm" not in MAMBA2_PRESETS["field"]


def test_compare_prints_and_writes_the_ranking(hf_dir, tmp_path, capsys):
    run_modes(hf_dir, tmp_path, ["fp32", "0", "naive-static", "smq-ssm"], seq_len=16, end_to_end=True)
    capsys.readouterr()
    rc = run_cli(compare_main, [tmp_path / "capture.npz", "--json", tmp_path / "c.json"])
    out = capsys.readouterr().out
    assert rc == 0 and "recipes side by side against fp32 (ranked by end-to-end KL" in out
    ranking = json.loads((tmp_path / "c.json").read_text())["recipe_ranking"]
    assert {r["mode"] for r in ranking} == {"0", "naive-static", "smq-ssm"}
    assert [r["rank"] for r in ranking] == [1, 2, 3] and all(r["kl"] is not None for r in ranking)
    assert {r["mode"]: r["recipe"] for r in ranking} == {"0": "quamba", "naive-static": "naive", "smq-ssm": "smq"}
    from harness.report.build import build_report
    html, _ = build_report(tmp_path / "capture.npz")
    assert '<section id="recipes">' in html and "Recipes side by side" in html
    assert html.index("smq-ssm", html.index('<section id="recipes">')) > 0
    plain = run_modes(hf_dir, tmp_path / "plain", ["fp32", "0"], seq_len=16) if (tmp_path / "plain").mkdir() is None \
        else None
    assert '<section id="recipes">' not in build_report(tmp_path / "plain" / "capture.npz")[0] and plain is not None
