"""Turn mutmut's results (mutants/) into docs/mutation.md: score per module, every survivor with a verdict.

    python tools/mutation_report.py [--save-baseline] [--out docs/mutation.md]

Score = killed / (mutants - equivalent), where killed includes timeouts (a mutant
that hangs the tests is caught) and "no tests" counts as not killed. Verdicts
live in tools/mutation_verdicts.toml, keyed by mutant name:

    [equivalent]     mutant = "why no test can tell it apart"
    [tested]         mutant = "the test added for it"   (for survivors of the baseline)

--save-baseline records the current results as the "before" column
(docs/mutation-baseline.json); run it once, on the first measurement.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from mutation import MODULES, statuses  # noqa: E402

BASELINE = ROOT / "docs" / "mutation-baseline.json"
VERDICTS = ROOT / "tools" / "mutation_verdicts.toml"
# the emulation core (everything under harness/kernels, emulation, architectures, the registries and the
# families' blocks) and the runner's numeric steps; the rest of MODULES is the file format, the metrics, the
# comparison and the checkpoint readers
CORE = {m for m in MODULES if m.startswith(("harness.kernels.", "harness.emulation.", "harness.architectures."))} | {
    "harness.recipes.registry", "harness.recipes.float.__init__", "harness.recipes.quamba.families",
    "harness.recipes.quamba.q2.build", "harness.recipes.quamba.w4.build", "harness.runner.backbone",
    "harness.runner.calibration", "harness.runner.layercache",
    "harness.recipes.quamba.calibration", "harness.recipes.quamba.q2.calibrate", "harness.runner.weightbank",
    "harness.runner.sharedops", "harness.runner.decode", "harness.checkpoints.text", "harness.runner.headprep",
    "harness.recipes.quamba.w4.calibrate_mamba2", "harness.recipes.quamba.q2.head_scale"}


UNCHECKED = ("not checked", "check was interrupted by user", "skipped")


def _counts(results: dict[str, str], equivalent: set[str]) -> dict:
    killed = sum(s in ("killed", "timeout", "caught by type check") for s in results.values())
    survived = [k for k, s in results.items() if s in ("survived", "no tests", "suspicious", "segfault")]
    unchecked = [k for k, s in results.items() if s in UNCHECKED]
    eq = [k for k in survived if k in equivalent]
    scored = len(results) - len(eq) - len(unchecked)
    return {"mutants": len(results), "killed": killed, "survived": len(survived) - len(eq), "equivalent": len(eq),
            "unchecked": len(unchecked), "score": (killed / scored) if scored else None, "survivors": survived}


def _diff_line(name: str) -> str:
    from mutmut.mutation.diff_apply import get_diff_for_mutant
    try:
        diff = get_diff_for_mutant(name)
    except Exception as e:  # a module edited since the run: the mutant no longer exists
        return f"(diff unavailable: {type(e).__name__})"
    minus = [ln[1:].strip() for ln in diff.splitlines() if ln.startswith("-") and not ln.startswith("---")]
    plus = [ln[1:].strip() for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    return f"`{' / '.join(minus)[:110]}` → `{' / '.join(plus)[:110]}`"


def _baseline_score(b: dict | None, equivalent: dict) -> float | None:
    """Score of the baseline run, with today's equivalence verdicts (they may be written after it ran)."""
    if not b or not b.get("checked"):
        return None
    survivors = set(b["survivors"])
    eq = len(survivors & set(equivalent))
    scored = len(b["checked"]) - eq
    return (len(b["checked"]) - len(survivors)) / scored if scored else None


def _pct(x) -> str:
    return "—" if x is None else f"{100 * x:.1f} %"


def _wilson(killed: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95 % Wilson score interval of a proportion killed / n (n > 0)."""
    p, zz = killed / n, z * z / n
    centre, half = (p + zz / 2) / (1 + zz), z * math.sqrt(p * (1 - p) / n + zz / (4 * n)) / (1 + zz)
    return max(0.0, centre - half), min(1.0, centre + half)


def _rel(path: Path) -> str:
    return str(path.resolve().relative_to(ROOT)) if path.resolve().is_relative_to(ROOT) else str(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "mutation.md")
    ap.add_argument("--survivors", type=Path, default=ROOT / "mutants" / "survivors.md",
                    help="where the listing of every surviving mutant and its verdict goes (generated on demand, "
                         "not committed; default: mutants/survivors.md)")
    ap.add_argument("--save-baseline", action="store_true")
    args = ap.parse_args(argv)
    os.chdir(ROOT)
    verdicts = tomllib.loads(VERDICTS.read_text()) if VERDICTS.is_file() else {}
    equivalent, tested = verdicts.get("equivalent", {}), verdicts.get("tested", {})
    baseline = json.loads(BASELINE.read_text()) if BASELINE.is_file() else {}
    checked_path = ROOT / "mutants" / "mutation-checked.json"  # tools/mutation_check.py --tested
    by_hand = {k for k, c in (json.loads(checked_path.read_text()) if checked_path.is_file() else {}).items()
               if c["killed"]}
    results = {}
    for m in MODULES:
        r = statuses(m)
        if r is None:
            continue
        # only this mutants/ directory's results: a mutant not run here is "not run", whatever an earlier run
        # of older code said (the baseline gives the "score before" column only)
        r = {k: "killed" if k in by_hand and s in ("survived", "no tests") else s for k, s in r.items()}
        if any(s not in UNCHECKED for s in r.values()):
            results[m] = r
    counts = {m: _counts(r, set(equivalent)) for m, r in results.items()}
    if args.save_baseline:
        for m, c in counts.items():
            if m not in baseline:
                baseline[m] = {**c, "checked": sorted(k for k, s in results[m].items() if s not in UNCHECKED)}
        BASELINE.write_text(json.dumps(baseline, indent=1) + "\n")
    timing_path = ROOT / "mutants" / "mutation-timing.json"
    timing = json.loads(timing_path.read_text()) if timing_path.is_file() else {}

    out = ["# Mutation testing", "",
           f"Generated by `make mutation` (`tools/mutation.py`, `tools/mutation_check.py --tested`, "
           f"`tools/mutation_report.py`) on "
           f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, mutmut 3.8.1.",
           *[line for paragraph in verdicts.get("status", []) for line in ("", paragraph)],
           "", "How it is run (pyproject `[tool.mutmut]`, `tools/mutation.py`):", "",
           "- mutants of every module listed below; per mutant, only the tests that call the mutated function "
           "(mutmut's per-function test selection), file by file in each file's order, the cheapest file first by mutmut's "
           "measured durations (tests/conftest.py), stopping at the first failure; each worker runs torch on "
           "one thread (a child forked from the fork server hangs in a torch thread pool);",
           "- the unit and block-level tests take part; the subprocess CLI tests (a test that starts a subprocess "
           "skips itself under mutmut, tests/conftest.py: the child cannot run mutmut's trampolines) and the "
           "end-to-end tests that run whole pipelines (`test_mode_contracts`, `test_fp_contracts`, `test_lean`, `test_shipped_model`, "
           "`test_calibration`, `test_unrotate`) do not (10+ s per mutant on a loaded machine): a mutant that only "
           "they catch counts as surviving;",
           "- a mutant is a timeout only past (mutmut's estimate + 30 s) x 10 CPU seconds (a real hang); timeouts "
           "count as killed;",
           "- `make mutation` runs a seeded random 3 % of each module's mutants (`--fraction 0.03 --seed 1`; "
           "`FRACTION=1` runs all of them) and only mutants without a result in mutants/; column \"not run\" counts "
           "the others, and the score is then the score of the mutants run, with a 95 % Wilson interval per part;",
           "- operators: all of mutmut's, except that string literals are mutated only when they look like "
           "identifiers or keys (no spaces, at most 40 characters) and only as `\"XX…XX\"` (messages and docstrings "
           "are not mutated);",
           "- a mutant that mutmut reports surviving but that has a test verdict is applied by hand "
           "(`tools/mutation_check.py --tested`: inside its own class and function) and that test run: it counts "
           "as killed when the test fails (\"killed, checked by hand\"); mutmut's call statistics miss some "
           "tests (a function reached from a module-scoped fixture that another test set up);",
           "- score = killed (timeouts included) / (mutants − equivalent); \"no tests\" counts as surviving.",
           "", "## Score per module", "",
           "| module | part | mutants | killed | survived | equivalent | not run | score before | score now | run time |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m in MODULES:
        if m not in counts:
            out.append(f"| `{m}` | {'core' if m in CORE else 'format'} | not run | | | | | | | |")
            continue
        c, b = counts[m], baseline.get(m)
        runs = [(k[len(m):].strip(" ()") or "all", t) for k, t in timing.items() if k == m or k.startswith(m + " (")]
        secs = " + ".join(f"{t['seconds']:.0f} s ({t.get('mutants_run', 'all')}: {what})" for what, t in runs) or "—"
        out.append(f"| `{m}` | {'core' if m in CORE else 'format'} | {c['mutants']} | {c['killed']} | {c['survived']} | "
                   f"{c['equivalent']} | {c['unchecked']} | {_pct(_baseline_score(b, equivalent))} | {_pct(c['score'])} | {secs} |")
    for key, t in timing.items():
        if " + " in key:  # tools/mutation.py --one-call
            out.append(f"\nOne mutmut run for {key.count(' + ') + 1} modules ({key.replace(' + ', ', ')}): "
                       f"{t['seconds']:.0f} s with {t['max_children']} workers, {t['date']}.")
        if key.startswith("survivors of"):
            out.append(f"\nRerun of the survivors after the tests were added ({key}): {t['mutants_run']} mutants, "
                       f"{t['seconds']:.0f} s, {t['date']}.")
    for part, members in (("emulation core", CORE), ("file format and comparison", set(MODULES) - CORE)):
        cs = [counts[m] for m in MODULES if m in members and m in counts]
        if cs and sum(c["mutants"] - c["equivalent"] - c["unchecked"] for c in cs):
            killed = sum(c["killed"] for c in cs)
            scored = sum(c["mutants"] - c["equivalent"] - c["unchecked"] for c in cs)
            lo, hi = _wilson(killed, scored)
            out.append(f"\n**{part}**: {killed} of {scored} non-equivalent mutants run killed ({_pct(killed / scored)}; "
                       f"95 % interval {_pct(lo)} to {_pct(hi)}).")
    out += ["", "## Surviving mutants and verdicts", "",
            f"Listed by `make mutation` in `{_rel(args.survivors)}` (not committed: it is as large as the run; "
            f"`python tools/mutation_report.py --survivors FILE` writes it again from mutants/ and "
            f"tools/mutation_verdicts.toml, which holds every verdict)."]
    if verdicts.get("notes"):
        out += ["", "## Notes", ""] + [f"- {n}" for n in verdicts["notes"]]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(out) + "\n")
    out = ["# Surviving mutants and verdicts", "",
            "Every mutant of the present code that survived (now, or in an earlier run) with its verdict: the test "
            "for it, or why it is equivalent. Mutant names follow mutmut (`mutmut show NAME` prints the diff).", ""]
    for m in MODULES:
        names = set(counts.get(m, {}).get("survivors", [])) | set((baseline.get(m) or {}).get("survivors", []))
        mine = results.get(m) or statuses(m) or {}  # a module none of whose mutants ran: all "not in this run"
        names |= {n for n in (*tested, *equivalent) if n.startswith(m + ".") and n in mine}
        names &= set(mine)  # a mutant of code since edited or moved is gone: not a survivor of this code
        not_run = {n for n in names if mine.get(n, "gone") in UNCHECKED}  # survivors of an earlier run
        if not names:
            continue
        out += [f"### `{m}`", ""]
        for name in sorted(names, key=lambda n: (n in not_run, n.rsplit("__mutmut_", 1)[0], int(n.rsplit("_", 1)[1]))):
            status = mine.get(name, "gone")
            if status in UNCHECKED:
                status = "not in this run"
            if name in equivalent:
                verdict = f"equivalent{' (not in this run)' if status == 'not in this run' else ''}: {equivalent[name]}"
            elif name in tested:
                how = "killed, checked by hand" if name in by_hand else "killed" if status == "killed" else \
                    "not in this run; test added when it survived an earlier one" if status == "not in this run" \
                    else status.upper()
                verdict = f"{how}: {tested[name]}"
            elif status in ("killed", "timeout"):
                verdict = "killed by the tests added in this change"
            elif status == "not in this run":
                verdict = "not in this run, survived an earlier one, **no verdict yet**"
            else:
                verdict = f"**{status}, no verdict yet**"
            out.append(f"- `{name.split('.', 1)[1]}` {_diff_line(name)}: {verdict}")
        out.append("")
    args.survivors.parent.mkdir(parents=True, exist_ok=True)
    args.survivors.write_text("\n".join(out) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
