"""The local lm-eval tasks the repository ships, and the check of the tasks a run asks for.

Two tasks read the data in data/lmeval/ (made from the shipped held-out text by data/lmeval/make_tasks.py), so an
evaluation runs on a fresh machine with nothing to download:

* ``quamba_lastword``: last-word prediction in LAMBADA's layout (lm-eval 0.4.13's lambada_openai.yaml: the same
  doc_to_text / doc_to_target / metrics): accuracy (the target is the greedy continuation) and perplexity.
* ``quamba_rolling``: rolling perplexity of whole documents (wikitext.yaml's layout: word_perplexity,
  byte_perplexity, bits_per_byte over a ``page`` field), every token scored.

lm-eval resolves a relative ``data_files`` path against the working directory, so ``write_local_tasks`` writes the
YAMLs with absolute paths, resolved when a run starts, into a directory handed to lm-eval's ``include_path``.
"""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["LOCAL_DATA_DIR", "LOCAL_TASKS", "TaskError", "write_local_tasks", "local_task_files", "check_data_files"]

LOCAL_DATA_DIR = Path(__file__).resolve().parents[2] / "data" / "lmeval"  # the repository root's data/lmeval


class TaskError(ValueError):
    """An unknown task, or a local data file that is missing: the message names it and what is valid."""


_LASTWORD = {
    "task": "quamba_lastword", "dataset_path": "json", "output_type": "loglikelihood", "test_split": "test",
    "doc_to_text": "{{text.split(' ')[:-1]|join(' ')}}", "doc_to_target": "{{' '+text.split(' ')[-1]}}",
    "metric_list": [{"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
                    {"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    "metadata": {"version": 1.0},
}
_ROLLING = {
    "task": "quamba_rolling", "dataset_path": "json", "output_type": "loglikelihood_rolling", "test_split": "test",
    "doc_to_text": "", "doc_to_target": "{{page}}",
    "metric_list": [{"metric": "word_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
                    {"metric": "byte_perplexity", "aggregation": "weighted_perplexity", "higher_is_better": False},
                    {"metric": "bits_per_byte", "aggregation": "bits_per_byte", "higher_is_better": False}],
    "metadata": {"version": 1.0},
}
# task name -> (its YAML without the data, its data file in LOCAL_DATA_DIR)
LOCAL_TASKS: dict[str, tuple[dict, str]] = {"quamba_lastword": (_LASTWORD, "lastword.jsonl"),
                                             "quamba_rolling": (_ROLLING, "rolling.jsonl")}


def local_task_files(data_dir: Path | None = None) -> dict[str, Path]:
    """Each local task's data file (absolute; data_dir None: LOCAL_DATA_DIR)."""
    where = Path(LOCAL_DATA_DIR if data_dir is None else data_dir)
    return {name: (where / data).resolve() for name, (_, data) in LOCAL_TASKS.items()}


def check_data_files(files: dict[str, Path]) -> None:
    missing = [f"{task}: {path}" for task, path in files.items() if not Path(path).is_file()]
    if missing:
        raise TaskError(f"missing local data file(s) of the tasks asked for ({'; '.join(missing)}); rebuild them "
                        f"with python data/lmeval/make_tasks.py")


def write_local_tasks(target: Path, tasks: list[str] | None = None, data_dir: Path | None = None) -> Path:
    """The local tasks (all, or those of `tasks` that are local) as lm-eval YAMLs in `target` with absolute data
    paths; returns `target` (an ``include_path``). JSON is YAML: the files are written as JSON."""
    target.mkdir(parents=True, exist_ok=True)
    files = local_task_files(data_dir)
    chosen = {t: files[t] for t in (tasks if tasks is not None else list(LOCAL_TASKS)) if t in LOCAL_TASKS}
    check_data_files(chosen)
    for name, path in chosen.items():
        spec = {**LOCAL_TASKS[name][0], "dataset_kwargs": {"data_files": {"test": str(path)}}}
        (target / f"{name}.yaml").write_text(json.dumps(spec, indent=1) + "\n", encoding="utf-8")
    return target
