"""`python -m harness eval`: the run, NAME_eval.json, what an interruption keeps, and bad input (exit 2)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import math
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from helpers import run_cli  # noqa: E402

import harness.lmeval.tasks as local_tasks  # noqa: E402
from harness.cli.evaluate import eval_main  # noqa: E402
from harness.lmeval.run import EvalConfig, run_eval  # noqa: E402
from harness.runner.calibration import CalibrationSettings  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# --max_length 64: each example scored on its last 64 tokens (the first three of quamba_lastword have 143, 257 and 99;
# the emulated scan of 2-1 costs by the token): no assertion here depends on the context's length
FAST = ["--calib_data_num", "4", "--calib_seqlen", "32", "--calib_batch_size", "2", "--bootstrap_iters", "200",
        "--max_length", "64"]


def test_eval_writes_each_mode_its_examples_and_the_paired_difference(tmp_path, capsys):
    rc = run_cli(eval_main, ["--modes", "fp32", "2-1", "--tasks", "quamba_lastword", "--limit", "3",
                             "--output", tmp_path / "run", *FAST])
    out = capsys.readouterr().out
    assert rc == 0, out
    doc = json.loads((tmp_path / "run_eval.json").read_text())
    assert doc["schema"] == "quamba-harness-eval/1" and doc["reference"] == "fp32"
    assert list(doc["modes"]) == ["fp32", "2-1"] and all(e["status"] == "ok" for e in doc["modes"].values())
    assert set(doc["calibration"]) == {"quamba"}  # one calibration (2-1's key)
    for mode in ("fp32", "2-1"):
        task = doc["modes"][mode]["tasks"]["quamba_lastword"]
        assert [s["doc_id"] for s in task["samples"]] == [0, 1, 2]
        assert set(task["metrics"]) == {"acc", "perplexity"}
        lls = [s["perplexity"] for s in task["samples"]]  # per example: the target's log-likelihood
        assert task["metrics"]["perplexity"]["value"] == pytest.approx(math.exp(-sum(lls) / 3), rel=1e-9)
    ref, q = (doc["modes"][m]["tasks"]["quamba_lastword"]["samples"] for m in ("fp32", "2-1"))
    pair = doc["paired"]["2-1"]["quamba_lastword"]
    assert pair["acc"]["n"] == 3 and {"lost", "gained"} <= set(pair["acc"])
    ppl = lambda s: math.exp(-sum(x["perplexity"] for x in s) / len(s))  # noqa: E731
    assert pair["perplexity"]["difference"] == pytest.approx(ppl(q) - ppl(ref), rel=1e-9)
    assert pair["perplexity"]["low"] <= pair["perplexity"]["difference"] <= pair["perplexity"]["high"]
    lines = local_tasks.local_task_files()["quamba_lastword"].read_text().splitlines()
    assert doc["examples"]["quamba_lastword"] == {str(k): json.loads(lines[k])["text"] for k in range(3)}
    assert all("text" not in s for s in ref + q)  # each example's text once, under "examples"
    assert "quamba_lastword (3 examples" in out and "| 2-1 " in out and "(reference)" in out


def test_an_interrupted_eval_keeps_the_modes_finished(tmp_path):
    def emit(line: str) -> None:
        if line == "mode fp32: done":
            raise KeyboardInterrupt

    cfg = EvalConfig(model=ROOT / "models" / "mamba-tiny", modes=["fp32", "2-1"], tasks=["quamba_lastword"],
                     output=tmp_path / "cut", limit=2, calib=CalibrationSettings(4, 32, batch_size=2), max_length=64)
    with pytest.raises(KeyboardInterrupt):
        run_eval(cfg, emit=emit)
    doc = json.loads((tmp_path / "cut_eval.json").read_text())
    assert doc["modes"]["fp32"]["status"] == "ok"
    assert doc["modes"]["2-1"]["status"] == "pending" and doc["modes"]["2-1"]["tasks"] == {}
    assert len(doc["modes"]["fp32"]["tasks"]["quamba_lastword"]["samples"]) == 2


def test_a_mode_the_architecture_lacks_is_exit_2(tmp_path, capsys):
    rc = run_cli(eval_main, ["--model", ROOT / "models" / "mamba2-tiny", "--modes", "fp32", "2-1",
                             "--tasks", "quamba_lastword", "--limit", "1", "--output", tmp_path / "x", *FAST])
    err = capsys.readouterr().err
    assert rc == 2 and "'2-1'" in err and "mamba2" in err and "Traceback" not in err
    assert not (tmp_path / "x_eval.json").exists()


def test_a_missing_local_data_file_is_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(local_tasks, "LOCAL_DATA_DIR", tmp_path / "nowhere")
    rc = run_cli(eval_main, ["--tasks", "quamba_rolling", "--output", tmp_path / "x"])
    err = capsys.readouterr().err
    assert rc == 2 and str(tmp_path / "nowhere" / "rolling.jsonl") in err and "make_tasks.py" in err


def test_an_include_path_that_is_no_directory_is_exit_2(tmp_path, capsys):
    rc = run_cli(eval_main, ["--include_path", tmp_path / "none", "--output", tmp_path / "x"])
    assert rc == 2 and "--include_path" in capsys.readouterr().err


def test_an_unknown_task_is_exit_2_naming_it(tmp_path, capsys):
    rc = run_cli(eval_main, ["--tasks", "quamba_lastword", "no_such_task_xyz", "--output", tmp_path / "x"])
    err = capsys.readouterr().err
    assert rc == 2 and "no_such_task_xyz" in err and "quamba_lastword" in err and "Traceback" not in err


def test_a_generation_task_on_an_eval_only_mode_is_exit_2(tmp_path, capsys):
    """Quamba-SE's modes have no token-by-token step (recipe.decode_problem): a generate_until task is refused
    before any work, naming the task and the mode; the loglikelihood tasks are not."""
    task = tmp_path / "tasks"
    task.mkdir()
    (task / "gen_stand_in.yaml").write_text(
        "task: gen_stand_in\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: "
        f"{tmp_path / 'none.jsonl'}\ntest_split: test\noutput_type: generate_until\ndoc_to_text: '{{{{text}}}}'\n"
        "doc_to_target: ''\ngeneration_kwargs:\n  until: ['.']\nmetric_list:\n  - metric: exact_match\n")
    rc = run_cli(eval_main, ["--modes", "fp32", "5-1", "--tasks", "quamba_lastword", "gen_stand_in",
                             "--include_path", task, "--output", tmp_path / "x"])
    err = capsys.readouterr().err
    assert rc == 2 and "gen_stand_in" in err and "5-1" in err and "Traceback" not in err, err
    assert "quamba_lastword" not in err.split("generate text")[0]
    assert not list(tmp_path.glob("x*"))  # nothing written


def _without_times(doc: dict) -> dict:
    return {m: {k: v for k, v in e.items() if k != "seconds"} for m, e in doc["modes"].items()}


def _short_rolling_task(where: Path) -> Path:
    """quamba_rolling's YAML as task short_rolling over the opening 9 lines (78 tokens) of its first document: two
    windows at max_length 64 (the whole 559-token document is nine, each through the emulated model)."""
    page = json.loads(local_tasks.local_task_files()["quamba_rolling"].read_text().splitlines()[0])["page"]
    where.mkdir()
    (where / "short.jsonl").write_text(json.dumps({"page": "\n".join(page.split("\n")[:9])}) + "\n")
    spec = {**local_tasks.LOCAL_TASKS["quamba_rolling"][0], "task": "short_rolling",
            "dataset_kwargs": {"data_files": {"test": str(where / "short.jsonl")}}}
    (where / "short_rolling.yaml").write_text(json.dumps(spec))
    return where


def test_workers_give_the_serial_runs_results(tmp_path):
    """A loglikelihood task and a rolling one (two windows), fp32 and 2-1: four units, serial and in 2 workers."""
    cfg = dict(model=ROOT / "models" / "mamba-tiny", modes=["fp32", "2-1"], tasks=["quamba_lastword", "short_rolling"],
               include_path=[_short_rolling_task(tmp_path / "tasks")], limit=1,
               calib=CalibrationSettings(4, 32, batch_size=2), bootstrap_iters=200, max_length=64)
    serial = run_eval(EvalConfig(output=tmp_path / "serial", **cfg), emit=lambda _l: None)
    lines: list[str] = []
    fanned = run_eval(EvalConfig(output=tmp_path / "fanned", workers=2, **cfg), emit=lines.append)
    assert _without_times(fanned) == _without_times(serial)
    assert fanned["paired"] == serial["paired"] and fanned["paired"]["2-1"]["short_rolling"]
    assert sorted(line for line in lines if line.endswith(": done")) == ["mode 2-1: done", "mode fp32: done"]
    on_disk = json.loads((tmp_path / "fanned_eval.json").read_text())
    assert list(on_disk["modes"]) == ["fp32", "2-1"] and list(on_disk["modes"]["2-1"]["tasks"]) == cfg["tasks"]


def test_ctrl_c_exits_130_and_names_what_the_file_keeps(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "harness", "eval", "--modes", "fp32", "2-1", "--tasks",
                             "quamba_lastword", "--limit", "2", "--output", tmp_path / "sig", *FAST],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
    try:
        for line in proc.stdout:
            if line.strip() == "mode fp32: done":
                proc.send_signal(signal.SIGINT)
                break
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert f"interrupted by SIGINT while evaluating: {tmp_path / 'sig_eval.json'} holds every mode" in err
    assert "Traceback" not in err
    modes = json.loads((tmp_path / "sig_eval.json").read_text())["modes"]
    assert modes["fp32"]["status"] == "ok" and modes["2-1"]["status"] in ("pending", "running")


def test_lm_evals_own_command_line_runs_quamba_harness_on_the_local_tasks(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "harness.lmeval", "run", "--model", "quamba-harness", "--model_args",
                        f"pretrained={ROOT / 'models' / 'mamba-tiny'}", "mode=fp32", "no_cache=True", "--tasks",
                        "quamba_lastword", "--limit", "1", "--device", "cpu"],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "|quamba_lastword|" in r.stdout and "perplexity" in r.stdout


def test_a_calibration_text_too_short_is_exit_2_before_any_unit(tmp_path, capsys):
    rc = run_cli(eval_main, ["--modes", "fp32", "2-1", "--tasks", "quamba_lastword", "--output", tmp_path / "x",
                             "--calib_data_num", "100000", "--calib_seqlen", "512"])
    err = capsys.readouterr().err
    assert rc == 2 and "--calib_data_num 100000 is too many" in err and not (tmp_path / "x_eval.json").exists()
