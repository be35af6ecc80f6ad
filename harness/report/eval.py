"""The accuracy tables of an eval file (``python -m harness eval``'s NAME_eval.json, docs/eval.md): one per task,
each mode's metrics with their stderr and the paired difference from the reference with its interval; ``report
NAME_eval.json`` prints them and writes them as one HTML page with the examples each mode flipped."""
from __future__ import annotations

import json
from pathlib import Path

from tabulate import tabulate

from ..store.files import atomic_write
from ..store.format import StorageError, check_writable
from .html import esc, page

__all__ = ["task_tables", "is_eval_file", "eval_report"]


def is_eval_file(path: Path) -> bool:
    return Path(path).name.endswith("_eval.json")


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def _task_parts(modes: dict, paired: dict, reference: str, fmt: str) -> list[tuple[str, str, str]]:
    """(task, title, table) per task: each mode's metrics (value ± stderr) and its paired difference from the
    reference (fmt: tabulate's table format; "html" escapes the cells)."""
    tasks = list(dict.fromkeys(t for e in modes.values() if e.get("status") == "ok" for t in e["tasks"]))
    parts = []
    for task in tasks:
        metrics = list(dict.fromkeys(m for e in modes.values() if e.get("status") == "ok"
                                     for m in e["tasks"].get(task, {}).get("metrics", {})))
        rows = []
        for mode, entry in modes.items():
            if entry.get("status") != "ok":
                rows.append([mode] + [f"error: {entry.get('error', '?')}"] + [""] * (2 * len(metrics) - 1))
                continue
            got = entry["tasks"].get(task, {}).get("metrics", {})
            row = [mode]
            for m in metrics:
                v = got.get(m)
                row.append("-" if v is None else f"{v['value']:.4g} ± {_fmt(v['stderr'])}")
                d = paired.get(mode, {}).get(task, {}).get(m)
                row.append("(reference)" if mode == reference else "-" if d is None else
                           f"{d['difference']:+.4g} [{_fmt(d['low'])}, {_fmt(d['high'])}]")
            rows.append(row)
        head = ["mode"] + [h for m in metrics for h in (m, f"Δ {m} vs {reference}")]
        n = max((len(e["tasks"].get(task, {}).get("samples", [])) for e in modes.values() if e.get("status") == "ok"),
                default=0)
        parts.append((task, f"{task} ({n} examples; Δ: paired difference, 95% bootstrap interval)",
                      tabulate(rows, headers=head, tablefmt=fmt)))
    return parts


def task_tables(modes: dict, paired: dict, reference: str) -> str:
    """The tables as text, one per task under its title line."""
    return "\n\n".join(f"{title}\n{table}" for _, title, table in _task_parts(modes, paired, reference, "github"))



def _flips(paired: dict) -> list[str]:
    lines = []
    for mode, tasks in paired.items():
        for task, metrics in tasks.items():
            for metric, d in metrics.items():
                if "lost" in d:
                    lines.append(f"{mode} on {task} ({metric}): lost {d['lost'] or 'none'}, gained {d['gained'] or 'none'}")
    return lines


def eval_report(path: Path, output: Path | None = None) -> tuple[str, Path]:
    """The text tables of an eval file and the HTML page written beside it (default NAME_eval.html)."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        modes, paired, reference = doc["modes"], doc.get("paired", {}), doc["reference"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise StorageError(f"{path} is no eval file of python -m harness eval ({type(e).__name__}: {e})") from None
    text = task_tables(modes, paired, reference)
    flips = _flips(paired)
    out = Path(output) if output is not None else Path(path).with_suffix(".html")
    if out.resolve() == Path(path).resolve():
        raise StorageError(f"-o {out} is the eval file itself; name an .html file")
    check_writable(out)
    parts = _task_parts(modes, paired, reference, "html")
    sections = [f'<section id="{esc(task)}"><h2>{esc(title)}</h2>{table}</section>' for task, title, table in parts]
    if flips:
        sections.append('<section id="flipped"><h2>Examples flipped (doc ids)</h2><ul>'
                        + "".join(f"<li>{esc(x)}</li>" for x in flips) + "</ul></section>")
    subtitle = esc(f"{doc.get('model', '?')}: tasks {', '.join(doc.get('tasks', []))}; limit {doc.get('limit')}; "
                   f"reference {reference}; Δ: the paired difference over the same examples, 95% bootstrap interval")
    nav = [(task, task) for task, _, _ in parts] + ([("flipped", "flipped")] if flips else [])
    html = page(f"lm-eval: {Path(path).name}", subtitle, nav, sections)
    atomic_write(out, lambda f: f.write(html.encode("utf-8")))
    return text + ("\n\n" + "\n".join(flips) if flips else ""), out
