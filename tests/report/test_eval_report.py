"""`report NAME_eval.json`: the accuracy table per task, the paired differences and the flipped examples, printed
and written as HTML (no lm-eval needed: the eval file is plain JSON)."""
from __future__ import annotations

import json

from helpers import run_cli

from harness.cli.main import report_main

DOC = {"schema": "quamba-harness-eval/1", "model": "/m/mamba-tiny", "reference": "fp32", "tasks": ["lastword"],
       "limit": 4,
       "modes": {"fp32": {"status": "ok", "tasks": {"lastword": {
                     "metrics": {"acc": {"value": 0.75, "stderr": 0.25, "aggregation": "mean"}},
                     "samples": [{"doc_id": i, "acc": a} for i, a in enumerate([1, 1, 0, 1])]}}},
                 "<b>2-1</b>": {"status": "ok", "tasks": {"lastword": {
                     "metrics": {"acc": {"value": 0.5, "stderr": 0.2887, "aggregation": "mean"}},
                     "samples": [{"doc_id": i, "acc": a} for i, a in enumerate([1, 0, 1, 0])]}}},
                 "3": {"status": "error", "error": "calibration failed", "tasks": {}}},
       "paired": {"<b>2-1</b>": {"lastword": {"acc": {"difference": -0.25, "low": -0.75, "high": 0.25, "n": 4,
                                                       "lost": [1, 3], "gained": [2]}}}}}


def test_report_of_an_eval_file_prints_and_writes_the_tables(tmp_path, capsys):
    path = tmp_path / "run_eval.json"
    path.write_text(json.dumps(DOC))
    assert run_cli(report_main, [path]) == 0
    out = capsys.readouterr().out
    assert "lastword (4 examples" in out
    assert "| fp32 " in out and "0.75 ± 0.25" in out and "(reference)" in out
    assert "-0.25 [-0.75, 0.25]" in out and "error: calibration failed" in out
    assert "<b>2-1</b> on lastword (acc): lost [1, 3], gained [2]" in out
    html = (tmp_path / "run_eval.html").read_text()
    assert "&lt;b&gt;2-1&lt;/b&gt;" in html and "<b>2-1</b>" not in html  # mode names are escaped
    assert "-0.25 [-0.75, 0.25]" in html and "lost [1, 3]" in html


def test_a_broken_eval_file_or_itself_as_output_is_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad_eval.json"
    bad.write_text("{\"modes\": 1}")
    assert run_cli(report_main, [bad]) == 2 and "no eval file" in capsys.readouterr().err
    good = tmp_path / "run_eval.json"
    good.write_text(json.dumps(DOC))
    assert run_cli(report_main, [good, "-o", good]) == 2 and "eval file itself" in capsys.readouterr().err
    assert json.loads(good.read_text()) == DOC
