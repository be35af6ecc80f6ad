"""docs/eval.md's recipe for lm-eval's Hub tasks offline: lambada_openai's own YAML, included, with its dataset_path
pointed at a local file (data/lmeval/lastword.jsonl stands in: it has LAMBADA's layout), scores every example as
the local quamba_lastword task does (the same prompts, the same responses)."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

import lm_eval  # noqa: E402
from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import harness.lmeval  # noqa: E402,F401
from harness.lmeval.tasks import local_task_files, write_local_tasks  # noqa: E402

MODEL = Path(__file__).resolve().parents[2] / "models" / "mamba-tiny"
DOCS = [0, 1, 2]


def _override(where: Path) -> Path:
    lambada = Path(lm_eval.__file__).parent / "tasks" / "lambada" / "lambada_openai.yaml"
    where.mkdir()
    (where / "lambada_openai_local.yaml").write_text(
        f"include: {lambada}\ntask: lambada_openai_local\ndataset_path: json\ndataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n    test: {local_task_files()['quamba_lastword']}\n")
    return where


def test_a_hub_task_pointed_at_a_local_copy_scores_as_the_local_task(tmp_path):
    tm = TaskManager(include_path=[str(write_local_tasks(tmp_path / "local")), str(_override(tmp_path / "over"))],
                     include_defaults=False)
    # max_length=64: each example scored on its last 64 tokens (up to 257 whole), the same cut for both tasks
    r = simple_evaluate(model="quamba-harness", model_args=f"pretrained={MODEL},mode=fp32,max_length=64,no_cache=True",
                        tasks=["lambada_openai_local", "quamba_lastword"], task_manager=tm, device="cpu",
                        samples={"lambada_openai_local": DOCS, "quamba_lastword": DOCS}, bootstrap_iters=0)
    hub, local = (sorted(r["samples"][t], key=lambda s: s["doc_id"]) for t in ("lambada_openai_local", "quamba_lastword"))
    assert [s["doc_id"] for s in hub] == DOCS
    assert [s["arguments"] for s in hub] == [s["arguments"] for s in local]
    assert [s["resps"] for s in hub] == [s["resps"] for s in local]
    assert r["results"]["lambada_openai_local"]["perplexity,none"] == r["results"]["quamba_lastword"]["perplexity,none"]
