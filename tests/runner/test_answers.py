"""Issue 21, "Wrong or misleading answers": the sensitivity order, perplexity over samples, pooled tables
said to be pooled, compare's filters on every table, and a failed mode that is never a pass."""
import json
import math

import numpy as np
import pytest

from harness.cli import capture_main, compare_main
from harness.metrics.intervals import mean_ci, paired_difference
from harness.metrics.logits import pooled_perplexity
from harness.metrics.ranking import ORDER_TEXT, rank_layers
from harness.report.text import at_header, end_to_end_table, sensitivity_rankings, sensitivity_tables
from harness.runner.studies import end_to_end_stats
from helpers import run_cli

CALIB = ["--calib_data_num", "4", "--calib_seqlen", "32", "--calib_batch_size", "2", "--no_cache"]

# the case: layer 2 has the lower isolated SQNR, layer 0 twice the KL
COMPARISON = {"reference": "fp32", "modes": {"2-4": {
    "output": {"sqnr_db": 30.0}, "L0.block.isolated": {"sqnr_db": 30.0},
    "L1.block.out": {"sqnr_db": 28.0}, "L1.block.isolated": {"sqnr_db": 35.0},
    "L2.block.out": {"sqnr_db": 25.0}, "L2.block.isolated": {"sqnr_db": 27.0}}}}
SENSITIVITY = {"2-4": {"0": {"kl": 0.001602, "kl_share": 0.49}, "1": {"kl": 0.0002, "kl_share": 0.06},
                       "2": {"kl": 0.000818, "kl_share": 0.25}}}


def _layers(text: str, mode: str) -> list[str]:
    """The layer column of the printed sensitivity table of `mode`, top to bottom."""
    lines = text[text.index(f"Sensitivity of mode {mode} "):].splitlines()
    rows = []
    for line in lines[3:]:
        if not line.strip() or not line.split()[0].isdigit():
            break
        rows.append(line.split()[0])
    return rows


def test_ranking_is_by_the_kl_of_each_layer_alone_where_measured():
    rows = sensitivity_rankings(COMPARISON, SENSITIVITY)["2-4"]
    assert rows["ranked_by"] == "kl" and [r["layer"] for r in rows["layers"]] == [0, 2, 1]
    text = sensitivity_tables(COMPARISON, SENSITIVITY, "fp32")
    assert "most harmful first" in text and _layers(text, "2-4") == ["0", "2", "1"]
    # without the KL: isolated SQNR, lowest first, and the heading says so (not "most harmful")
    iso = sensitivity_rankings(COMPARISON, None)["2-4"]
    assert iso["ranked_by"] == "isolated_sqnr_db" and [r["layer"] for r in iso["layers"]] == [2, 0, 1]
    text = sensitivity_tables(COMPARISON, None, "fp32")
    assert ORDER_TEXT["isolated_sqnr_db"] in text and "most harmful" not in text
    # NaN is the worst value, a layer without the measure comes last
    key, ranked = rank_layers([{"layer": 0, "kl": 0.5}, {"layer": 1, "kl": math.nan}, {"layer": 2, "kl": None},
                               {"layer": 3, "kl": "inf"}])
    assert key == "kl" and [r["layer"] for r in ranked] == [1, 3, 0, 2]


def test_perplexity_over_windows_is_exp_of_the_mean_nll_and_differences_are_paired():
    # two windows of 3 and 1 predicted tokens: pooled NLL = (3 * 1 + 1 * 3) / 4 = 1.5
    assert pooled_perplexity([1.0, 3.0], [3, 1]) == pytest.approx(math.exp(1.5), rel=1e-15)
    ces = (4.0, 4.1, 4.05, 4.02)
    shift = math.log(1.005)   # the mode: every window's perplexity 0.5 % higher
    rows = {"fp32": [{"kl": 0.0, "top1_agreement": 1.0, "cross_entropy": c, "perplexity": math.exp(c), "predicted": 7}
                     for c in ces],
            "q": [{"kl": 0.1, "top1_agreement": 0.9, "cross_entropy": c + shift, "perplexity": math.exp(c + shift),
                   "predicted": 7} for c in ces]}
    e2e = end_to_end_stats(rows, "fp32")
    ref, q = e2e["fp32"]["perplexity"], e2e["q"]["perplexity"]
    assert ref["pooled"] == pytest.approx(math.exp(np.mean(ces)), rel=1e-14)          # exp(mean NLL)
    assert ref["pooled"] < ref["per_window"]["mean"]                                 # not the mean of the windows'
    assert ref["per_window"]["mean"] == pytest.approx(np.mean(np.exp(ces)), rel=1e-14)
    assert (ref["per_window"]["min"], ref["per_window"]["max"]) == (math.exp(4.0), math.exp(4.1))
    assert "perplexity_diff" not in e2e["fp32"]
    want = paired_difference([r["perplexity"] for r in rows["q"]], np.exp(ces))
    assert e2e["q"]["perplexity_diff"] == want
    # the paired interval excludes 0 while the per-window interval of one mode holds both modes' pooled values
    assert want["ci95"][0] > 0
    lo, hi = mean_ci(np.exp(ces))["ci95"]
    assert lo < ref["pooled"] < hi and lo < q["pooled"] < hi
    table = end_to_end_table(e2e, "fp32")
    assert "exp(mean NLL over every predicted token of every window)" in table and "perplexity - fp32" in table
    one = end_to_end_stats({m: r[:1] for m, r in rows.items()}, "fp32")
    assert one["fp32"]["perplexity"] == math.exp(4.0)
    assert one["q"]["perplexity_diff"] == math.exp(4.0 + shift) - math.exp(4.0)


def test_at_column_names_its_indices():
    assert at_header("output", 3) == "at (b, t, c)"
    assert at_header("L1.block.out", 4) == "at (sample, b, t, c)"
    assert at_header("L0.ssm.state", 4) == "at (sample, b, c, state)"
    assert at_header("logits", 4) == "at (sample, b, t, vocab)"
    assert at_header("L0.x", 6) == "at (index)"


@pytest.fixture(scope="module")
def sampled(hf_dir, tmp_path_factory):
    """fp32, 1, 2-4 over 2 samples, layers 0-1, isolated outputs and sensitivity; what the capture printed."""
    d = tmp_path_factory.mktemp("sampled")
    out = d / "c.npz"
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = capture_main(["--model", str(hf_dir), "--modes", "fp32", "1", "2-4", "--layers", "0-1", "--isolated",
                           "--sensitivity", "--samples", "2", "--seq_len", "16", *CALIB, "--output_file", str(out)])
    assert rc == 0
    return out, buf.getvalue()


def test_capture_says_its_table_is_pooled_and_prints_the_sample_means(sampled):
    out, printed = sampled
    stats = json.loads(out.with_name("c_stats.json").read_text())
    assert "Pooled over the 2 samples" in printed and "comparison against fp32, pooled over the samples" in printed
    mean = stats["samples"]["metrics"]["2-4"]["L1.block.out"]["sqnr_db"]
    line = next(x for x in printed.splitlines() if x.startswith("2-4") and "L1.block.out" in x and "[" in x)
    assert f"{mean['mean']:.6g} [{mean['ci95'][0]:.6g}, {mean['ci95'][1]:.6g}]" in line
    # the pooled SQNR differs from the per-sample mean: both are printed, each under its name
    assert stats["comparison"]["modes"]["2-4"]["L1.block.out"]["sqnr_db"] != mean["mean"]


def test_compare_filters_apply_to_the_sensitivity_tables(sampled, capsys):
    out, _ = sampled
    assert run_cli(compare_main, [out]) == 0
    full = capsys.readouterr().out
    assert "Sensitivity of mode 1 against fp32" in full and "Sensitivity of mode 2-4 against fp32" in full
    assert "Pooled over the 2 samples" in full and "at (sample, b, t, c)" in full
    assert run_cli(compare_main, [out, "--modes", "2-4", "--tensors", "logits", "L1.block.out",
                                  "--json", out.with_name("f.json")]) == 0
    text = capsys.readouterr().out
    assert "Sensitivity of mode 1" not in text and "vs fp32" in text
    table = text[text.index("Sensitivity of mode 2-4"):]
    assert ORDER_TEXT["kl"] in table and "accumulated SQNR" in table
    assert "isolated SQNR dB" not in table and _layers(table, "2-4") == ["1"]   # layer 1 only
    ranking = json.loads(out.with_name("f.json").read_text())["sensitivity_ranking"]
    assert list(ranking) == ["2-4"] and [r["layer"] for r in ranking["2-4"]["layers"]] == [1]


def test_compare_json_text_and_report_rank_alike(sampled, capsys):
    from harness.report.data import load_report_data

    out, _ = sampled
    assert run_cli(compare_main, [out, "--json", out.with_name("all.json")]) == 0
    printed = capsys.readouterr().out
    ranking = json.loads(out.with_name("all.json").read_text())["sensitivity_ranking"]
    stats = json.loads(out.with_name("c_stats.json").read_text())
    report = load_report_data(out).sensitivity()
    for mode in ("1", "2-4"):
        kl = stats["sensitivity"][mode]
        by_kl = sorted(kl, key=lambda k: -kl[k]["kl"])
        assert ranking[mode]["ranked_by"] == "kl"
        assert [str(r["layer"]) for r in ranking[mode]["layers"]] == by_kl
        assert [str(r["layer"]) for r in report[mode]] == by_kl
        assert ORDER_TEXT["kl"] in printed[printed.index(f"Sensitivity of mode {mode} "):].splitlines()[0]
        assert _layers(printed, mode) == by_kl


def test_a_failed_mode_is_never_a_pass(hf_dir, tmp_path, monkeypatch, capsys):
    """2-4 fails at layer 1 (as a checkpoint with x_H_scale = 0 in layer 1 does): its layer-0 arrays stay in
    the file; compare --fail-if must not pass it, and says which tensors are missing."""
    import harness.runner.forwards as forwards

    real = forwards.layer_arrays

    def failing(recipe, basis, per_sample, codes, meta):
        if recipe.name == "2-4" and any(n.startswith("L1.") for n in per_sample):
            raise RuntimeError("non-finite values in layer 1")
        return real(recipe, basis, per_sample, codes, meta)
    monkeypatch.setattr(forwards, "layer_arrays", failing)
    out = tmp_path / "f.npz"
    assert run_cli(capture_main, ["--model", hf_dir, "--modes", "fp32", "1", "2-4", "--layers", "0-1",
                                  "--seq_len", "16", *CALIB, "--output_file", out]) == 1
    capsys.readouterr()
    stats = json.loads(out.with_name("f_stats.json").read_text())
    assert stats["modes"]["2-4"]["status"] == "error" and stats["failed_modes"] == ["2-4"]
    with np.load(out, allow_pickle=False) as z:
        assert "mode_2-4_output" in z and "mode_2-4__L1.block.out" not in z   # layer 0 left behind
    rc = run_cli(compare_main, [out, "--fail-if", "sqnr_db < 10", "--json", tmp_path / "j.json"])
    printed = capsys.readouterr()
    assert rc == 1
    line = next(x for x in printed.err.splitlines() if x.startswith("mode 2-4 FAILED in the capture"))
    assert line.startswith("mode 2-4 FAILED in the capture (RuntimeError: non-finite values in layer 1); "
                           "tensors of fp32 it has no array for: ")
    missing = {"L1.block.in", "L1.block.out", "L1.block.residual"}
    assert set(line.split(": ")[-1].split(", ")) == missing
    assert "a mode in error is never a pass" in printed.err and "FAILED in the capture" in printed.out
    failed = json.loads((tmp_path / "j.json").read_text())["failed_modes"]
    assert list(failed) == ["2-4"] and failed["2-4"]["error"] == "RuntimeError: non-finite values in layer 1"
    assert set(failed["2-4"]["missing"]) == missing
    # the mode that ran is judged as before: only it selected, the gate passes
    assert run_cli(compare_main, [out, "--modes", "1", "--fail-if", "sqnr_db < 10"]) == 0
    assert run_cli(compare_main, [out, "--modes", "2-4", "--fail-if", "sqnr_db < -1000"]) == 1


def test_a_layer_without_its_measure_ranks_last_in_any_order():
    """Rows missing the ranking measure go last whichever way the measure runs (a mutant that gave measured rows
    the missing rows' rank survived: SQNR, lower is worse, put a missing 0 dB row among the measured ones)."""
    from harness.metrics.ranking import rank_layers

    rows = [{"layer": 0, "isolated_sqnr_db": 30.0}, {"layer": 1, "isolated_sqnr_db": None},
            {"layer": 2, "isolated_sqnr_db": 20.0}]
    key, ranked = rank_layers(rows)
    assert key == "isolated_sqnr_db" and [r["layer"] for r in ranked] == [2, 0, 1]
