"""The key proof: mode fp32 through quamba-harness scores as lm-eval's own hf model on the same model and tasks.

Both run through lm-eval 0.4.13's simple_evaluate on the shipped models/mamba-tiny and the local tasks (offline);
accuracy (and each example's is-greedy) must be equal, each example's log-likelihood and the perplexities within
1e-4 relative. The examples of the last-word task include two the model gets right (doc 18 and 26), so accuracy
compares hits, not only misses; max_length=96 cuts the rolling task's documents (about 500 tokens) into several
windows, so the rolling windows are compared too."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")  # lm-eval's hf model imports it

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import harness.lmeval  # noqa: E402,F401  (registers quamba-harness)
from harness.lmeval.model import QuambaHarnessLM  # noqa: E402
from harness.lmeval.tasks import write_local_tasks  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models" / "mamba-tiny"
DOCS = {"quamba_lastword": [0, 1, 2, 3, 18, 26], "quamba_rolling": [0, 1]}
REL = 1e-4


@pytest.fixture(scope="module")
def tm(tmp_path_factory):
    return TaskManager(include_path=str(write_local_tasks(tmp_path_factory.mktemp("tasks"))), include_defaults=False)


def _evaluate(model: str, args: str, task: str, tm) -> dict:
    return simple_evaluate(model=model, model_args=args, tasks=[task], samples={task: DOCS[task]}, task_manager=tm,
                           batch_size=4, device="cpu", bootstrap_iters=0, log_samples=True)


def _tuple(resp) -> tuple:
    """A response: (loglikelihood, is_greedy) of a loglikelihood request, the loglikelihood alone of a rolling one."""
    return tuple(resp) if isinstance(resp, (list, tuple)) else (resp,)


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL)


def test_registering_keeps_lm_evals_own_models():
    assert get_model("quamba-harness") is QuambaHarnessLM
    assert get_model("hf").__name__ == "HFLM"


def _compare(model: Path, task: str, tm) -> list:
    """fp32 through quamba-harness against lm-eval's hf model on `model`: every example and metric; the hf samples."""
    ref = _evaluate("hf", f"pretrained={model},dtype=float32,max_length=96", task, tm)
    ours = _evaluate("quamba-harness", f"pretrained={model},mode=fp32,max_length=96,no_cache=True", task, tm)
    r_samples = sorted(ref["samples"][task], key=lambda s: s["doc_id"])
    o_samples = sorted(ours["samples"][task], key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in o_samples] == [s["doc_id"] for s in r_samples] == DOCS[task]
    for r, o in zip(r_samples, o_samples):
        assert len(o["resps"]) == len(r["resps"])
        for (r_ll, *r_greedy), (o_ll, *o_greedy) in ((_tuple(x[0]), _tuple(y[0])) for x, y in zip(r["resps"], o["resps"])):
            assert _close(o_ll, r_ll), (r["doc_id"], o_ll, r_ll)
            assert o_greedy == r_greedy, r["doc_id"]  # is-greedy (loglikelihood); nothing (rolling)
    rows = ref["results"][task], ours["results"][task]
    metrics = [k for k in rows[0] if "," in k and "_stderr" not in k]
    assert metrics
    for key in metrics:
        if key.startswith("acc"):
            assert rows[1][key] == rows[0][key], key
        else:
            assert _close(rows[1][key], rows[0][key]), (key, rows[1][key], rows[0][key])
    return r_samples


@pytest.mark.parametrize("task", list(DOCS))
def test_fp32_scores_as_lm_evals_hf_model(task, tm):
    r_samples = _compare(MODEL, task, tm)
    if task == "quamba_lastword":
        assert sum(s["acc"] for s in r_samples) == 2  # hits are compared, not only misses


@pytest.mark.parametrize("task", list(DOCS))
def test_a_hybrid_scores_as_lm_evals_hf_model(task, tm):
    """The shipped Bamba hybrid (Mamba-2, attention and MLP blocks; issue 34) through quamba-harness scores as
    lm-eval's hf model (transformers' BambaForCausalLM) on both local tasks."""
    _compare(ROOT / "models" / "bamba-tiny", task, tm)
