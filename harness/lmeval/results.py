"""One evaluation unit's result (a mode on a task) as lm-eval hands it back, reduced to what ``NAME_eval.json`` keeps
(each metric's value and stderr, the per-example values), the paired comparisons with the reference mode, and the
tables the command prints.

lm-eval 0.4.13's ``simple_evaluate`` result: ``results[task]["<metric>,<filter>"]`` and
``"<metric>_stderr,<filter>"`` ("N/A" where none), ``samples[task]``: one dict per example with ``doc_id``,
``metrics`` (the names) and each metric's per-example value (a number, or a (loglikelihood, count) pair).
"""
from __future__ import annotations

from pathlib import Path

from ..report.eval import task_tables
from .paired import AGGREGATIONS, flipped, paired_difference

# task_tables: report.eval's, the eval run's tables
__all__ = ["unit_result", "example_text", "aggregation_of", "pair_modes", "task_tables", "eval_path"]


def eval_path(name: str | Path) -> Path:
    """--output NAME -> NAME_eval.json (a name already ending so is kept)."""
    name = Path(name)
    return name if name.name.endswith("_eval.json") else name.with_name(name.name + "_eval.json")


def _number(value):
    return None if value in ("N/A", None) else float(value)


def aggregation_of(metric: str) -> str:
    """The aggregation lm-eval uses for `metric` by default (mean when it names none)."""
    from lm_eval.api.registry import get_metric_aggregation

    try:
        fn = get_metric_aggregation(metric)
    except Exception:  # an unregistered metric: lm-eval itself falls back to the mean
        fn = None
    name = getattr(fn, "__name__", "mean")
    return name if name in AGGREGATIONS else "mean"


def _plain(value):
    return [float(v) for v in value] if isinstance(value, (list, tuple)) else float(value)


def example_text(sample: dict) -> str:
    """The text of an example's first request: context and continuation of a loglikelihood request, the document
    of a rolling one, the prompt of a generation (what ``capture --text_file`` can run through the layers)."""
    args = (sample.get("arguments") or [()])[0]
    return "".join(a for a in args if isinstance(a, str))


def unit_result(evaluated: dict) -> dict:
    """task -> {"metrics": {metric: {"value", "stderr", "aggregation"}}, "samples": [{"doc_id", metric: value}]}
    of one simple_evaluate result (every task it holds, groups' subtasks included)."""
    out = {}
    for task, row in evaluated["results"].items():
        metrics = {}
        for key, value in row.items():
            if "," not in key or "_stderr," in key:
                continue
            metric, filt = key.split(",", 1)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            label = metric if filt == "none" else f"{metric},{filt}"
            metrics[label] = {"value": float(value), "stderr": _number(row.get(f"{metric}_stderr,{filt}")),
                              "aggregation": aggregation_of(metric)}
        samples = []
        for s in evaluated.get("samples", {}).get(task, []):
            names = s.get("metrics") or [m for m in metrics if m in s]
            samples.append({"doc_id": int(s["doc_id"]), **{m: _plain(s[m]) for m in names if m in s},
                            "text": example_text(s)})
        out[task] = {"metrics": metrics, "samples": sorted(samples, key=lambda x: x["doc_id"])}
    return out


def pair_modes(modes: dict, reference: str, *, iters: int = 1000, seed: int = 0) -> dict:
    """mode -> task -> metric -> the paired difference from `reference` over the examples both scored (and, for
    accuracy-like 0/1 metrics, the examples the mode lost and gained)."""
    ref = modes.get(reference, {})
    if ref.get("status") != "ok":
        return {}
    out: dict = {}
    for mode, entry in modes.items():
        if mode == reference or entry.get("status") != "ok":
            continue
        for task, result in entry["tasks"].items():
            base = ref["tasks"].get(task)
            if base is None:
                continue
            by_doc = {s["doc_id"]: s for s in base["samples"]}
            both = [(s, by_doc[s["doc_id"]]) for s in result["samples"] if s["doc_id"] in by_doc]
            for metric, info in result["metrics"].items():
                pairs = [(m[metric], r[metric]) for m, r in both if metric in m and metric in r]
                if not pairs:
                    continue
                diff = paired_difference(info["aggregation"], [p[0] for p in pairs], [p[1] for p in pairs],
                                         iters=iters, seed=seed)
                values = {v for p in pairs for v in p if not isinstance(v, list)}
                if values and values <= {0.0, 1.0}:
                    diff.update(flipped([m["doc_id"] for m, r in both if metric in m and metric in r],
                                        [p[0] for p in pairs], [p[1] for p in pairs]))
                out.setdefault(mode, {}).setdefault(task, {})[metric] = diff
    return out
