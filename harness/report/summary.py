"""The report's first screen: the worst mode, the worst layer by KL, the first layer where the error jumps.

Read from what the file holds, worst first:
- worst mode: the highest end-to-end KL (--end-to-end), else the lowest SQNR of the last block output;
- worst layer by KL: the highest KL with only that layer quantized (stats["sensitivity"], --sensitivity);
  without it, the lowest isolated SQNR (--isolated) is named instead, and the page says which;
- the first layer where the error jumps: the first layer of the worst mode whose block output has at
  least JUMP_DB dB less SQNR than what it was given (layer 0: the model's input; layer i: layer i-1's output).
Bit-identical modes (the comparison's identical groups) are one row, named together ("2-0 = 2-1").
"""
from __future__ import annotations

import math

from .data import ReportData, as_float, block_out_name, measured_float
from .groups import group_label, identical_of
from .html import esc, fmt_value, section, table

__all__ = ["summary_section", "JUMP_DB", "MAX_ROWS", "mode_facts"]

JUMP_DB = 3.0
MAX_ROWS = 10


def _kl(d: ReportData, mode: str) -> float | None:
    return measured_float(d.end_to_end().get(mode, {}).get("kl"))


def _sqnr(d: ReportData, mode: str, tensor: str) -> float | None:
    row = ((d.comparison or {}).get("modes", {}).get(mode) or {}).get(tensor)
    return as_float(row.get("sqnr_db")) if isinstance(row, dict) else None


def _worst_layer_kl(d: ReportData, mode: str) -> tuple[int, float, float | None] | None:
    """(layer, KL with only it quantized, its share) of the highest KL, from stats["sensitivity"]."""
    by_layer = (d.stats.get("sensitivity") or {}).get(mode) if isinstance(d.stats.get("sensitivity"), dict) else None
    best = None
    for layer, entry in (by_layer or {}).items() if isinstance(by_layer, dict) else ():
        kl = as_float(entry.get("kl")) if isinstance(entry, dict) else None
        if kl is not None and str(layer).isdigit() and (best is None or kl > best[1]):
            best = (int(layer), kl, as_float(entry.get("kl_share")))
    return best


def _jump(d: ReportData, mode: str, layers: list[int], acc: list[float | None]) -> tuple[int, float, float] | None:
    """(layer, SQNR given, SQNR after) of the first layer losing at least JUMP_DB dB."""
    given = _sqnr(d, mode, "input")
    given = math.inf if given is None else given
    for layer, after in zip(layers, acc):
        if after is None:
            continue
        if given - after >= JUMP_DB:
            return layer, given, after
        given = after
    return None


def mode_facts(d: ReportData) -> list[dict]:
    """One dict per group of bit-identical modes (the reference's group left out), worst first."""
    layers, acc, _ = d.layer_sqnr()
    groups = {members[0]: members for members in identical_of(d.comparison, d.modes).values()}
    facts = []
    for head, members in groups.items():
        if d.reference in members:
            continue
        series = acc.get(head) or []
        final = next((v for v in reversed(series) if v is not None), None)
        if final is None and d.layers():
            final = _sqnr(d, head, block_out_name(max(d.layers())))
        facts.append({"mode": head, "label": group_label(members), "kl": _kl(d, head), "final_sqnr": final,
                      "worst_layer": _worst_layer_kl(d, head),
                      "jump": _jump(d, head, layers, series) if series else None})
    by_kl = any(f["kl"] is not None for f in facts)

    def badness(f: dict) -> float:
        v = f["kl"] if by_kl else (None if f["final_sqnr"] is None else -f["final_sqnr"])
        return -math.inf if v is None or math.isnan(v) else v
    return sorted(facts, key=badness, reverse=True)


def _headlines(d: ReportData, facts: list[dict]) -> list[str]:
    worst = facts[0]
    lines = []
    if worst["kl"] is not None:
        lines.append(f"<b>Worst mode:</b> {esc(worst['label'])}: end-to-end KL {fmt_value(worst['kl'])}"
                     + (f", last block output {fmt_value(worst['final_sqnr'])} dB SQNR" if worst["final_sqnr"] is not None else ""))
    elif worst["final_sqnr"] is not None:
        lines.append(f"<b>Worst mode:</b> {esc(worst['label'])}: last block output {fmt_value(worst['final_sqnr'])} dB "
                     "SQNR (no end-to-end KL in this file: --end-to-end)")
    ranked = [f for f in facts if f["worst_layer"] is not None]
    if ranked:
        top = max(ranked, key=lambda f: f["worst_layer"][1])
        layer, kl, share = top["worst_layer"]
        lines.append(f"<b>Worst layer by KL:</b> layer {layer} in {esc(top['label'])}: KL {fmt_value(kl)} with only "
                     "this layer quantized" + (f" ({fmt_value(100 * share)} % of the mode's)" if share is not None else ""))
    else:
        lines.append("<b>Worst layer by KL:</b> not measured in this file (capture with --sensitivity)")
    if worst["jump"] is not None:
        layer, given, after = worst["jump"]
        lines.append(f"<b>Error first jumps</b> in {esc(worst['label'])} at layer {layer}: SQNR "
                     f"{fmt_value(given)} dB in, {fmt_value(after)} dB out (a loss of at least {JUMP_DB:g} dB)")
    elif len(d.layers()) > 0 and worst["final_sqnr"] is not None:
        lines.append(f"<b>Error first jumps:</b> no layer of {esc(worst['label'])} loses {JUMP_DB:g} dB or more")
    return lines


def summary_section(d: ReportData) -> str:
    facts = mode_facts(d)
    if not facts or all(f["kl"] is None and f["final_sqnr"] is None for f in facts):
        return ""
    body = "<ul>" + "".join(f"<li>{line}</li>" for line in _headlines(d, facts)) + "</ul>"
    cols = [("label", "modes"), ("kl", "end-to-end KL"), ("final_sqnr", "last block output SQNR dB"),
            ("worst_layer", "worst layer by KL (KL)"), ("jump", "error jumps at layer")]
    cols = [c for c in cols if any(f[c[0]] is not None for f in facts)]

    def cell(f: dict, key: str):
        v = f[key]
        if key == "worst_layer" and v is not None:
            return f"{v[0]} ({fmt_value(v[1])})"
        if key == "jump" and v is not None:
            return f"{v[0]} ({fmt_value(v[1])} to {fmt_value(v[2])} dB)"
        return v
    rows = [[cell(f, k) for k, _ in cols] for f in facts[:MAX_ROWS]]
    body += table([h for _, h in cols], rows)
    if len(facts) > MAX_ROWS:
        body += f'<p class="note">{len(facts) - MAX_ROWS} more modes (or groups) in the sections below.</p>'
    return section("Summary", body, "summary",
                   f"Modes worst first against {esc(d.reference)}; bit-identical modes are one row (a = b).")
