"""The recipes side by side (issue 33, docs/field-recipes.md): one row per mode of a capture, ranked, with the
metrics every recipe is judged by -- the layer-0 output's SQNR against the reference, the mean SQNR of the
per-layer isolated outputs (--isolated), the end-to-end KL and top-1 agreement (--end_to_end), and lm-eval's
accuracy where the stats hold one. `compare` prints it (and --json writes it as "recipe_ranking") when a mode of
the field's recipes (naive, smq, mambaquant) is in the capture."""
from __future__ import annotations

import math

from tabulate import tabulate

from .data import measured_float
from .html import esc, section, table
from .text import fmt

__all__ = ["recipe_rows", "recipe_table", "has_field_modes", "recipe_html"]

_FIRST = ("output", "L0.block.out")


def _family(entry: dict) -> str:
    recipe = entry.get("recipe") if isinstance(entry.get("recipe"), dict) else {}
    if recipe.get("family"):
        return str(recipe["family"])
    prep = str(recipe.get("prep", ""))
    return "quamba" if prep.startswith("quamba") else "float"


def has_field_modes(stats: dict) -> bool:
    modes = stats.get("modes") if isinstance(stats.get("modes"), dict) else {}
    return any(isinstance(e, dict) and isinstance(e.get("recipe"), dict) and e["recipe"].get("family")
               for e in modes.values())


def _sqnr(rows: dict, tensor: str) -> float | None:
    v = (rows.get(tensor) or {}).get("sqnr_db")
    return float(v) if isinstance(v, (int, float)) else None


def recipe_rows(comparison: dict, stats: dict) -> list[dict]:
    """Per compared mode: its recipe family and metrics, ranked by end-to-end KL (lowest first) where every row
    has one, else by the layer-0 output SQNR (highest first); rank 1 is the best."""
    entries = stats.get("modes") if isinstance(stats.get("modes"), dict) else {}
    e2e = stats.get("end_to_end") if isinstance(stats.get("end_to_end"), dict) else {}
    lm = stats.get("lm_eval") if isinstance(stats.get("lm_eval"), dict) else {}
    rows = []
    for mode, tensors in comparison.get("modes", {}).items():
        first = next((s for t in _FIRST if (s := _sqnr(tensors, t)) is not None), None)
        iso = [s for t in tensors if t.endswith(".block.isolated") and (s := _sqnr(tensors, t)) is not None]
        end = e2e.get(mode) if isinstance(e2e.get(mode), dict) else {}
        acc = lm.get(mode) if isinstance(lm.get(mode), dict) else {}
        rows.append({"mode": mode, "recipe": _family(entries.get(mode, {})), "layer0_sqnr_db": first,
                     "isolated_sqnr_db_mean": sum(iso) / len(iso) if iso else None, "kl": measured_float(end.get("kl")),
                     "top1_agreement": measured_float(end.get("top1_agreement")), "lm_eval_acc": measured_float(acc.get("acc"))})
    by_kl = all(isinstance(r["kl"], (int, float)) and math.isfinite(r["kl"]) for r in rows)
    key = (lambda r: r["kl"]) if by_kl else (lambda r: -(r["layer0_sqnr_db"] if r["layer0_sqnr_db"] is not None
                                                            else -math.inf))
    rows.sort(key=key)
    for rank, r in enumerate(rows, 1):
        r["rank"] = rank
    return rows


def recipe_table(rows: list[dict], reference: str) -> str:
    if not rows:
        return ""
    by = "end-to-end KL" if all(r["kl"] is not None for r in rows) else "layer-0 output SQNR"
    table = [[r["rank"], r["mode"], r["recipe"], fmt(r["layer0_sqnr_db"]), fmt(r["isolated_sqnr_db_mean"]),
              fmt(r["kl"]), fmt(r["top1_agreement"]), fmt(r["lm_eval_acc"])] for r in rows]
    head = ["rank", "mode", "recipe", "layer-0 SQNR dB", "isolated SQNR dB (mean)", "KL(ref||mode)", "top-1",
            "lm-eval acc"]
    notes = []
    if all(r["isolated_sqnr_db_mean"] is None for r in rows):
        notes.append("isolated: capture with --isolated")
    if all(r["kl"] is None for r in rows):
        notes.append("KL and top-1: capture with --end_to_end")
    notes.append("lm-eval: not in the harness yet")
    return (f"\nrecipes side by side against {reference} (ranked by {by}; {'; '.join(notes)}):\n"
            + tabulate(table, headers=head, disable_numparse=True))


def recipe_html(comparison: dict | None, stats: dict, reference: str) -> str:
    """The report's "Recipes side by side" section ("" when no mode of the field's recipes is in the file)."""
    if not comparison or not comparison.get("modes") or not has_field_modes(stats):
        return ""
    rows = recipe_rows(comparison, stats)
    body = table(["rank", "mode", "recipe", "layer-0 SQNR dB", "isolated SQNR dB (mean)", "KL(ref||mode)", "top-1",
                  "lm-eval acc"],
                 [[r["rank"], r["mode"], r["recipe"], fmt(r["layer0_sqnr_db"]), fmt(r["isolated_sqnr_db_mean"]),
                   fmt(r["kl"]), fmt(r["top1_agreement"]), fmt(r["lm_eval_acc"])] for r in rows], left=3)
    by = "end-to-end KL" if all(r["kl"] is not None for r in rows) else "layer-0 output SQNR"
    note = (f"Every mode's recipe against {esc(reference)}, ranked by {by} (docs/field-recipes.md); isolated: "
            "capture with --isolated; KL and top-1: --end_to_end; lm-eval: not in the harness yet.")
    return section("Recipes side by side", body, "recipes", note)
