"""The report's cross-run section (`report A.npz --against B.npz`): per mode, the first tensor in execution order
where the two runs differ (layer, point, decode step), its metrics, and the per-tensor metrics around it in
execution order. The comparison itself is ``compare A.npz --against B.npz``'s dict (metrics.crossrun.compare_runs
with the files' names); this module only lays it out."""
from __future__ import annotations

from ..metrics.crossrun import locate, no_difference_text
from .html import esc, facts, section, table

__all__ = ["crossrun_section", "CONTEXT_BEFORE", "ROWS"]

CONTEXT_BEFORE = 3   # tensors shown before the first differing one
ROWS = 16            # rows of the per-tensor table per mode at most (all rows: compare --against --json)
_METRICS = (("rel_l2", "rel L2"), ("sqnr_db", "SQNR dB"), ("max_abs", "max|err|"), ("max_abs_index", "at"),
            ("cosine", "cosine"), ("mse", "MSE"))


def _where(entry: dict) -> list[tuple[str, object]]:
    first = entry["first_differing"]
    if first is None:
        return [("first differing tensor", no_difference_text(entry))]
    layer, point = locate(first["tensor"])
    return [("first differing tensor", first["tensor"]), ("layer", layer), ("point", point),
            ("decode step", first["step"])]


def _first_facts(entry: dict) -> str:
    first = entry["first_differing"]
    pairs = _where(entry)
    if first is not None:
        row = entry["tensors"][first["tensor"]]
        at_step = row.get("at_first_bad_step")
        pairs.append(("elements beyond tolerance", row.get("bad_elements")))
        pairs += [(f"{title} (whole tensor)", row.get(key)) for key, title in _METRICS]
        pairs += [(f"{title} (at step {first['step']})", at_step.get(key)) for key, title in _METRICS if at_step]
    return facts(pairs)


def _window(names: list[str], first: dict | None) -> tuple[int, int]:
    """[start, stop) of the rows shown: a few before the first differing tensor, up to ROWS in all."""
    start = 0 if first is None else max(0, names.index(first["tensor"]) - CONTEXT_BEFORE)
    return start, min(len(names), start + ROWS)


def _tensor_table(entry: dict) -> str:
    names = list(entry["tensors"])          # compare_runs inserts them in execution order
    first = entry["first_differing"]
    start, stop = _window(names, first)
    rows, marks = [], []
    for name in names[start:stop]:
        row = entry["tensors"][name]
        layer, point = locate(name)
        rows.append([name, layer, point, row.get("first_bad_step"), row["equal"], row["within_tolerance"],
                     *(row.get(k) for k, _ in _METRICS if k != "max_abs_index")])
        marks.append("worst" if first is not None and name == first["tensor"] else "")
    headers = ["tensor", "layer", "point", "first bad step", "equal", "within tolerance",
               *(t for k, t in _METRICS if k != "max_abs_index")]
    shown = f"tensors {start + 1}-{stop} of {len(names)} in execution order"
    skipped = "".join(f"<br>{esc(t)} skipped: {esc(why)}" for t, why in entry.get("skipped", {}).items())
    return (table(headers, rows, left=3, classes=[[m] * len(headers) for m in marks])
            + f'<p class="note">{shown}{skipped}</p>')


def crossrun_section(result: dict | None) -> str:
    """The section, or "" without a cross-run comparison."""
    if not result or not result.get("modes"):
        return ""
    parts = [facts([("run A", result.get("a")), ("run B (the metrics' reference)", result.get("b")),
                    ("atol", result["atol"]), ("rtol", result["rtol"])])]
    for mode, entry in result["modes"].items():
        parts.append(f"<h3>mode {esc(mode)}</h3>{_first_facts(entry)}{_tensor_table(entry)}")
    return section("Across runs", "".join(parts), "crossrun",
                   "The same mode's tensors of two files (docs/decode.md, compare --against): the first tensor in "
                   "execution order (the prefill block by block and point by point, the logits, then each decode "
                   "step) where |A - B| &gt; atol + rtol&#183;|B| anywhere, its metrics over the whole tensor and at "
                   "its first bad step, and the per-tensor metrics around it (highlighted).")
