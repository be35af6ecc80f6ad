"""compare A.npz --against B.npz: the first tensor in execution order where two runs differ."""
import json
import re

import numpy as np
import pytest

from harness.cli import capture_main, compare_main
from harness.emulation.capture import array_key
from harness.metrics.crossrun import execution_key
from harness.runner.crossrun import CrossRunError, compare_files
from harness.store.reader import load_capture
from helpers import FAST_CLI, run_cli


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """A capture with decode steps, and a copy (no manifest, as a GPU dump) where two tensors of mode 0 differ:
    decode.L0.block.out at step 3 and decode.L1.ssm.out at step 2 (the earlier one in execution order)."""
    d = tmp_path_factory.mktemp("cross")
    a = d / "A.npz"
    assert run_cli(capture_main, ["--modes", "fp32", "0", *FAST_CLI, "--decode", 4, "--layers", "0", "1",
                                  "--taps", "ssm.out", "--output_file", a, "--quiet"]) == 0
    cap = load_capture(a)
    arrays = {array_key(m, t): np.array(cap.array(m, t)) for m in cap.modes() for t in cap.tensors(m)}
    arrays["token_ids"] = np.array(cap.npz["token_ids"])
    arrays[array_key("0", "decode.L0.block.out")][0, 3, 7] += 1e-2
    arrays[array_key("0", "decode.L1.ssm.out")][0, 2, 5] += 1e-3
    b = d / "B.npz"
    np.savez(b, **arrays)
    return a, b, d


def test_the_first_differing_tensor_is_the_earliest_in_execution_order(two_runs):
    a, b, _ = two_runs
    result = compare_files(a, b)
    assert result["modes"]["fp32"]["first_differing"] is None
    mode0 = result["modes"]["0"]
    assert mode0["first_differing"] == {"tensor": "decode.L1.ssm.out", "step": 2}
    row = mode0["tensors"]["decode.L0.block.out"]
    assert not row["equal"] and row["first_bad_step"] == 3 and row["max_abs"] == pytest.approx(1e-2, rel=1e-3)
    assert all(r["equal"] for t, r in mode0["tensors"].items() if t not in ("decode.L0.block.out", "decode.L1.ssm.out"))


def test_tolerances_decide_what_counts_as_differing(two_runs):
    a, b, _ = two_runs
    assert compare_files(a, b, atol=2e-3)["modes"]["0"]["first_differing"] == {"tensor": "decode.L0.block.out",
                                                                                  "step": 3}
    assert compare_files(a, b, atol=2e-2)["modes"]["0"]["first_differing"] is None


def test_execution_order_is_prefill_then_step_by_step():
    names = ["decode.L1.ssm.out", "L1.block.out", "input", "decode.logits", "logits", "L0.ssm.out", "decode.L0.block.in"]
    assert [n for n in sorted(names, key=execution_key)] == ["input", "L0.ssm.out", "L1.block.out", "logits",
                                                             "decode.L0.block.in", "decode.L1.ssm.out", "decode.logits"]
    assert execution_key("decode.L1.ssm.out", 0) < execution_key("decode.L0.block.in", 1)
    mamba2 = ["decode.L0.state.ssm", "decode.L0.block.out", "decode.L0.ssd.y", "decode.L0.in_proj.xBC", "L1.gnorm.out"]
    assert sorted(mamba2, key=execution_key) == ["L1.gnorm.out", "decode.L0.in_proj.xBC", "decode.L0.ssd.y",
                                                 "decode.L0.block.out", "decode.L0.state.ssm"]


def test_files_with_other_token_ids_are_refused(two_runs, capsys):
    a, b, d = two_runs
    with np.load(b) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["token_ids"] = arrays["token_ids"].copy()
    arrays["token_ids"][0, 5] += 1
    c = d / "C.npz"
    np.savez(c, **arrays)
    with pytest.raises(CrossRunError, match="token ids differ .first at position 5"):
        compare_files(a, c)
    assert run_cli(compare_main, [a, "--against", c]) == 2
    assert "token ids differ" in capsys.readouterr().err


def test_the_command_prints_and_writes_the_comparison(two_runs, capsys):
    a, b, d = two_runs
    out = d / "cmp.json"
    assert run_cli(compare_main, [a, "--against", b, "--json", out]) == 0
    text = capsys.readouterr().out
    assert "mode 0: first differing tensor: decode.L1.ssm.out at decode step 2" in text
    assert json.loads(out.read_text())["modes"]["0"]["first_differing"]["step"] == 2


def _files(d) -> dict:
    return {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}


def test_the_comparison_json_never_replaces_a_capture_or_its_stats(two_runs, capsys):
    """compare A --against B --json B_stats.json replaced B's stats (exit 0) and `compare B` then read the
    comparison as B's manifest: every file of either capture, and any capture's stats, is refused first."""
    a, b, d = two_runs
    (d / "other").mkdir(exist_ok=True)
    other = d / "other" / "kept.json"  # another capture's manifest, under a name of its own
    other.write_text(json.dumps({"schema_version": 3, "npz": {"sha256": "0" * 64}, "modes": {}}))
    before = _files(d)
    for argv in ([a, "--against", b], [a], [b]):
        for out in (d / "B_stats.json", d / "A_stats.json", a, b, d / ".A_stats.json.pending",
                    d / ".B_stats.json.pending", other):
            assert run_cli(compare_main, [*argv, "--json", out]) == 2, (argv, out)
            err = capsys.readouterr().err
            assert f"cannot write {out}: it is " in err and "choose another path" in err and "Traceback" not in err
    assert _files(d) == before and not (d / "B_stats.json").exists() and other.read_text().startswith('{"schema')
    assert "the --against capture's stats file of this run" in (run_cli(compare_main, [a, "--against", b, "--json",
                                                                  d / "B_stats.json"]), capsys.readouterr().err)[1]
    # a previous comparison (no schema_version, no npz, no .npz beside it) is replaced as before
    out = d / "cmp_again.json"
    for _ in range(2):
        assert run_cli(compare_main, [a, "--against", b, "--json", out]) == 0
    assert json.loads(out.read_text())["modes"]["0"]["first_differing"]["step"] == 2


def _cells(html: str, anchor: str) -> str:
    return html[html.index(f'<section id="{anchor}">'):].split("</section>")[0]


def test_the_report_shows_the_first_differing_tensor_its_metrics_and_the_tensors_around_it(two_runs):
    from harness.report.build import build_report
    from harness.report.crossrun import CONTEXT_BEFORE
    a, b, _ = two_runs
    result = compare_files(a, b)
    sec = _cells(build_report(a, crossrun=result)[0], "crossrun")
    mode0 = sec[sec.index("<h3>mode 0</h3>"):]
    facts = dict(re.findall(r'<tr><td class="l">([^<]*)</td><td class="l">([^<]*)</td></tr>', mode0))
    assert facts["first differing tensor"] == "decode.L1.ssm.out"
    assert (facts["layer"], facts["point"], facts["decode step"]) == ("1", "ssm.out", "2")
    assert facts["elements beyond tolerance"] == "1"
    assert float(facts["max|err| (at step 2)"]) == pytest.approx(1e-3, rel=1e-3)
    row = result["modes"]["0"]["tensors"]["decode.L1.ssm.out"]
    assert float(facts["rel L2 (whole tensor)"]) == pytest.approx(row["rel_l2"], rel=1e-3)
    # the table: execution order, starting CONTEXT_BEFORE tensors before the first differing one, which is marked
    names = list(result["modes"]["0"]["tensors"])
    shown = re.findall(r'<tr><td class="l[^"]*">([^<]*)</td>', mode0.split("<table>")[2])
    start = names.index("decode.L1.ssm.out") - CONTEXT_BEFORE
    assert shown == names[start:start + len(shown)] and len(shown) > CONTEXT_BEFORE
    assert '<td class="l worst">decode.L1.ssm.out</td>' in mode0
    fp32 = sec[sec.index("<h3>mode fp32</h3>"):sec.index("<h3>mode 0</h3>")]
    assert "none: every common tensor is within tolerance" in fp32 and "worst" not in fp32


def test_report_against_on_the_command_line(two_runs, capsys):
    from harness.cli import main
    a, b, d = two_runs
    out = d / "r.html"
    assert main(["report", str(a), "--against", str(b), "--atol", "2e-3", "-o", str(out)]) == 0
    sec = _cells(out.read_text(), "crossrun")
    assert "decode.L0.block.out" in sec and '<td class="l worst">decode.L1.ssm.out</td>' not in sec
    assert main(["report", str(a), "-o", str(d / "plain.html")]) == 0
    assert 'id="crossrun"' not in (d / "plain.html").read_text()
    with np.load(b) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["token_ids"] = arrays["token_ids"] + 1
    c = d / "C2.npz"
    np.savez(c, **arrays)
    capsys.readouterr()
    assert main(["report", str(a), "--against", str(c), "-o", str(d / "x.html")]) == 2
    assert "token ids differ" in capsys.readouterr().err and not (d / "x.html").exists()


def _rewrite(src, dst, change):
    """A copy of capture src (without its stats: a GPU dump) whose arrays `change` edits in place."""
    with np.load(src) as z:
        arrays = {k: np.array(z[k]) for k in z.files}
    change(arrays)
    np.savez(dst, **arrays)
    return dst


def test_fail_if_applies_to_the_cross_run_rows(two_runs, capsys):
    """--fail-if with --against used to be ignored (even a malformed expression exited 0)."""
    a, b, _ = two_runs
    assert run_cli(compare_main, [a, "--against", b, "--fail-if", "sqnr_db <"]) == 2
    assert "--fail-if" in capsys.readouterr().err
    assert run_cli(compare_main, [a, "--against", b, "--fail-if", "max_abs > 1e-3"]) == 1
    err = capsys.readouterr().err
    assert "for: 0 decode.L0.block.out" in err and "fp32" not in err.split("for:")[1]
    assert run_cli(compare_main, [a, "--against", b, "--fail-if", "max_abs > 1e-1"]) == 0
    assert run_cli(compare_main, [a, "--against", b, "--fail-if", "mode == '0' and not identical"]) == 1
    assert run_cli(compare_main, [a, "--against", a, "--fail-if", "not identical"]) == 0


def test_a_tensor_skipped_for_its_shape_is_never_called_within_tolerance(two_runs, capsys):
    a, b, d = two_runs
    c = _rewrite(b, d / "S.npz", lambda z: z.update({array_key("fp32", "decode.L0.block.out"):
                                                     z[array_key("fp32", "decode.L0.block.out")][:, :2]}))
    result = compare_files(a, c)
    entry = result["modes"]["fp32"]
    assert entry["first_differing"] is None and list(entry["skipped"]) == ["decode.L0.block.out"]
    assert run_cli(compare_main, [a, "--against", c]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("mode fp32:"))
    assert "within tolerance" not in line and "1 common tensor was skipped (not compared)" in line
    assert "decode.L0.block.out" in out and "skipped: shape [1, 4, " in out
    assert run_cli(compare_main, [a, "--against", c, "--fail-if", "max_abs > 1"]) == 1   # not compared: no pass
    assert "fp32 decode.L0.block.out" in capsys.readouterr().err


def test_runs_in_different_bases_warn_and_skip_the_tensors_whose_basis_differs(two_runs, capsys):
    import shutil
    from harness.store.format import stats_path
    a, _, d = two_runs
    r = d / "R.npz"
    shutil.copy(a, r)
    stats = json.loads(stats_path(a).read_text())
    stats["provenance"]["basis"] = "rotated"
    stats["modes"]["0"]["tensors"]["L1.block.out"]["basis"] = "rotated"
    stats_path(r).write_text(json.dumps(stats))
    result = compare_files(a, r)
    assert result["warnings"] and "A --basis original, B --basis rotated" in result["warnings"][0]
    assert result["modes"]["0"]["skipped"] == {"L1.block.out": "basis differs (original in A, rotated in B)"}
    assert "L1.block.out" not in result["modes"]["0"]["tensors"]
    assert run_cli(compare_main, [a, "--against", r]) == 0
    captured = capsys.readouterr()
    assert "warning: the runs were captured in different bases" in captured.err
    assert "warning: the runs were captured in different bases" in captured.out
    assert compare_files(a, a)["warnings"] == []
