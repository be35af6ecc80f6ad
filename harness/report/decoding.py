"""The report's decode sections: error and KL per decode step, the SSM state's drift, prefill/decode consistency
(--decode), and the free-running generation with its first divergence (--generate). Tables from the stats only."""
from __future__ import annotations

from .data import ReportData, as_float
from .html import esc, fmt_value, section, table

__all__ = ["decode_section", "generate_section"]


def _last(names, suffix: str) -> str | None:
    """The deepest layer's decode tensor ending in `suffix` (decode.L{i}.{suffix})."""
    found = sorted((int(n.split(".")[1][1:]), n) for n in names if n.startswith("decode.L") and n.endswith(suffix))
    return found[-1][1] if found else None


def _at(values, k: int):
    return as_float(values[k]) if values is not None and k < len(values) else None


def decode_section(d: ReportData) -> str:
    """Per mode and step: the deepest captured block output's relative L2 and the SSM state's SQNR against the
    reference, KL and top-1 of the logits, and the step against the mode's own prefill (consistency)."""
    rows = []
    for mode, entry in d.stats.get("modes", {}).items():
        dec = entry.get("decode") if isinstance(entry, dict) else None
        if not dec:
            continue
        per, cons = dec.get("per_step") or {}, dec.get("consistency") or {}
        out, state = _last(per or cons, ".block.out"), _last(per, ".state.ssm")
        logits = per.get("decode.logits", {})
        cons_out = (cons.get(out) or {}).get("per_step", {}).get("rel_l2") if out else None
        for k in range(int(dec.get("steps", 0))):
            rows.append([mode, dec.get("prompt_len", 0) + k, _at(per.get(out, {}).get("rel_l2"), k),
                         _at(logits.get("kl"), k), _at(logits.get("top1_agreement"), k),
                         _at(per.get(state, {}).get("sqnr_db"), k), _at(cons_out, k)])
    if not rows:
        return ""
    headers = ["mode", "position", "block out rel L2", "KL", "top-1", "state SQNR dB", "vs own prefill rel L2"]
    return section("Decode steps", table(headers, rows, left=1), "decode",
                   "Teacher-forced one-token steps after the prompt (docs/decode.md): the deepest captured block's "
                   "output and SSM state against the reference at each step (the state's SQNR is its drift), "
                   "KL(reference &#8214; mode) and top-1 agreement of the step's logits, and the step's block output "
                   "against the same mode's prefill at that position (what the int8 states cost).")


def _marked(tokens: list[str], first: int | None) -> str:
    return "".join(f"<mark>{esc(t)}</mark>" if k == first else esc(t) for k, t in enumerate(tokens))


def generate_section(d: ReportData) -> str:
    """Per mode: the first divergence from the reference's greedy tokens, the agreement, and both texts side by
    side with the first differing token marked."""
    modes = {m: e["generate"] for m, e in d.stats.get("modes", {}).items() if isinstance(e, dict) and e.get("generate")}
    ref = modes.get(d.reference)
    if not modes or ref is None:
        return ""
    rows = []
    for mode, gen in modes.items():
        if mode == d.reference:
            continue
        first = gen.get("first_divergence")
        rows.append([mode, "none" if first is None else first, as_float(gen.get("agreement")),
                     _marked(gen.get("tokens") or [gen.get("text", "")], first),
                     _marked(ref.get("tokens") or [ref.get("text", "")], first)])
    if not rows:
        return ""
    head = "".join(f'<th class="l">{esc(h)}</th>' for h in
                   ("mode", "first divergence (step)", "agreement", "mode's text", f"{d.reference}'s text"))
    cells = ("".join(f'<td class="l">{c if i >= 3 else esc(fmt_value(c))}</td>' for i, c in enumerate(r)) for r in rows)
    body = f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(f'<tr>{c}</tr>' for c in cells)}</tbody></table>"
    return section("Generation", body, "generate",
                   "Greedy tokens from the prompt, each mode through its own recurrent step (--generate): the first "
                   "step whose token differs from the reference's (marked in both texts) and the agreement rate.")
