"""What `compare` prints: the comparison tables, the per-sample means, the sensitivity tables with the
command's filters applied, and the modes the capture recorded as failed (docs/cli.md)."""
from __future__ import annotations

from typing import Mapping

from ..metrics.compare import failed_modes
from .data import layer_and_site
from .field_section import has_field_modes, recipe_rows, recipe_table
from .q2text import q2_group_text, q2_groups_of
from .segments import se_segment_text, se_segments_of
from .text import comparison_tables, failed_lines, sample_mean_table, sensitivity_rankings, sensitivity_tables

__all__ = ["compare_output", "gate_line"]


def compare_output(comparison: dict, stats: dict, tensors: Mapping[str, list[str]], reference: str,
                   modes_asked: list[str] | None, tensors_asked: list[str] | None) -> tuple[str, list[str]]:
    """(the text for stdout, the lines for stderr). Adds to `comparison` (what --json writes) "failed_modes"
    (metrics.compare.failed_modes of the modes asked for) and, with sensitivity or isolated data,
    "sensitivity_ranking" (report.text.sensitivity_rankings), and "q2_groups" (Quamba2's x group diagnostics,
    report.q2text), all with --modes and --tensors applied."""
    failed = failed_modes(stats, tensors, reference, lambda m: m in tensors or modes_asked is None or m in modes_asked)
    comparison["failed_modes"] = failed
    entries = stats.get("modes") if isinstance(stats.get("modes"), dict) else {}
    titles = {m: str(e.get("title", "")) for m, e in entries.items() if isinstance(e, dict)}
    titles.update({m: f"FAILED in the capture; {titles.get(m) or m}" for m in failed})
    samples = stats.get("samples") if isinstance(stats.get("samples"), dict) else {}
    parts = [comparison_tables(comparison, titles, samples.get("count")),
             sample_mean_table(samples, list(tensors), tensors_asked)]
    stored = stats.get("sensitivity") if isinstance(stats.get("sensitivity"), dict) else {}
    sensitivity = {m: v for m, v in stored.items() if m in comparison["modes"] and isinstance(v, dict)}
    layers = None if tensors_asked is None else {layer_and_site(t)[0] for t in tensors_asked} - {None}
    if sensitivity or any(t.endswith(".block.isolated") for rows in comparison["modes"].values() for t in rows):
        comparison["sensitivity_ranking"] = sensitivity_rankings(comparison, sensitivity, layers)
        parts.append(sensitivity_tables(comparison, sensitivity, reference, layers))
    q2 = q2_groups_of(stats, None if modes_asked is None else set(modes_asked), layers)  # Quamba2's x groups
    if q2:
        comparison["q2_groups"] = q2
        parts.append(q2_group_text(q2))
    segs = se_segments_of(stats, None if modes_asked is None else set(modes_asked), layers)  # Quamba-SE segments
    if segs:
        comparison["se_segments"] = segs
        parts.append(se_segment_text(segs))
    if has_field_modes(stats):  # the field's recipes beside Quamba's (issue 33)
        comparison["recipe_ranking"] = recipe_rows(comparison, stats)
        parts.append(recipe_table(comparison["recipe_ranking"], reference))
    return "\n".join(p for p in parts if p), failed_lines(failed, reference)


def gate_line(failed: Mapping[str, dict]) -> str:
    """--fail-if's line for modes in error: never a pass."""
    return (f"\n--fail-if: mode{'s' if len(failed) > 1 else ''} {', '.join(failed)} failed in the capture: "
            "a mode in error is never a pass")
