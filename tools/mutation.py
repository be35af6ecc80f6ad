"""Run mutmut over the emulation core and the file format.

    python tools/mutation.py [--max-children N] [--fraction F] [--one-call] [MODULE ...]   # default: every module

MODULE is a dotted name (harness.kernels.quant). mutmut keeps every result in mutants/ (edit a module and the
mutants of the functions changed are regenerated without one); only mutants without a result are handed
to mutmut, so a stopped run resumes where it stopped. (mutmut itself runs every mutant matching the names
it is given again, results or not: ``mutmut run 'harness.kernels.quant.*'`` starts over.)
``--fraction F`` runs a seeded random fraction of each module's mutants (at least one): the session-sized
check ``make mutation`` runs (F = 0.03, seed 1; about 600 of the 19929 mutants, an hour with two workers on this 2-core machine).
``--sample N`` runs N mutants per module instead, ``--rerun-survivors`` the surviving mutants again
(after adding tests). ``--one-call``: one mutmut run for all modules (one clean-test pass instead of one
per module). Wall time per run goes to mutants/mutation-timing.json, the mutants chosen by --fraction or
--sample to mutants/mutation-sample.json, for the report.

Operator subset: mutmut's string operator is narrowed to strings that look
like identifiers or keys (no spaces, at most 40 characters), one variant each
("XX...XX"). Messages and docstrings are left alone: a changed error message
is not a bug these tests are meant to catch, and they tripled the mutant count.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _only_mutate() -> tuple[str, ...]:
    """The modules of [tool.mutmut] only_mutate (globs expanded, do_not_mutate left out) as dotted names, in
    the order pyproject.toml lists them: the one list, so a module added there is mutated and reported."""
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]
    skip, out = set(cfg.get("do_not_mutate", [])), []
    for pattern in cfg["only_mutate"]:
        for path in sorted(ROOT.glob(pattern)):
            rel = path.relative_to(ROOT).as_posix()
            name = rel[:-len(".py")].replace("/", ".")
            if rel not in skip and name not in out:
                out.append(name)
    return tuple(out)


MODULES = _only_mutate()


def _narrow_string_operator() -> None:
    import libcst as cst
    from mutmut.mutation import mutators

    def operator_string(node):
        if not isinstance(node, cst.SimpleString):
            return
        body = node.evaluated_value if isinstance(node.evaluated_value, str) else ""
        if " " in body or len(body) > 40 or node.value.lstrip("rRbBuU").startswith(('"""', "'''")):
            return
        for variant in mutators.operator_string(node):
            yield variant
            return  # the first variant is "XX" + s + "XX"

    ops = mutators.mutation_operators
    for i, (kind, fn) in enumerate(ops):
        if fn is mutators.operator_string:
            ops[i] = (kind, operator_string)


def statuses(module: str) -> dict[str, str] | None:
    """mutmut's status of every mutant of a module ("killed", "survived", "not checked", ...), None before a run."""
    from mutmut.mutation.data import SourceFileMutationData
    from mutmut.stats import status_by_exit_code
    path = Path(*module.split(".")).with_suffix(".py")
    if not (ROOT / "mutants" / f"{path}.meta").is_file():
        return None
    m = SourceFileMutationData(path=path)
    m.load()
    return {k: status_by_exit_code[v] for k, v in m.exit_code_by_key.items()}


def _survivors(module: str) -> list[str]:
    now = statuses(module) or {}
    baseline = ROOT / "docs" / "mutation-baseline.json"   # survivors of the first (baseline) run
    before = set(json.loads(baseline.read_text()).get(module, {}).get("survivors", [])) if baseline.is_file() else set()
    return sorted(({k for k, s in now.items() if s in ("survived", "no tests")} | before) & set(now))


def _timed_run(names: list[str], max_children: int, key: str, mutants_run) -> int:
    """mutmut's run of `names`; its wall time goes to mutants/mutation-timing.json under `key`. Returns an
    exit status: mutmut exits on a failing clean run, and the caller stops there."""
    from mutmut.__main__ import _run
    start = time.perf_counter()
    try:
        _run(names, max_children)
    except SystemExit as e:
        if e.code not in (0, None):
            return int(e.code) if isinstance(e.code, int) else 1
    timing_path = ROOT / "mutants" / "mutation-timing.json"
    timing = json.loads(timing_path.read_text()) if timing_path.is_file() else {}
    timing[key] = {"seconds": round(time.perf_counter() - start, 1), "max_children": max_children,
                   "mutants_run": mutants_run, "load_avg_1min": os.getloadavg()[0],
                   "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    timing_path.write_text(json.dumps(timing, indent=1))
    return 0


def _all_statuses(module: str) -> dict[str, str]:
    """statuses(module), the mutants generated first when mutants/ has none yet."""
    found = statuses(module)
    if found is None:
        _generate()
        found = statuses(module)
    return found


def _generate() -> None:
    from mutmut.__main__ import copy_also_copy_files, copy_src_dir, create_mutants, setup_source_paths
    (ROOT / "mutants").mkdir(exist_ok=True)
    copy_src_dir()
    copy_also_copy_files()
    setup_source_paths()
    create_mutants(1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("modules", nargs="*", default=list(MODULES))
    ap.add_argument("--max-children", type=int, default=1, help="parallel mutant workers (default 1)")
    ap.add_argument("--rerun-survivors", action="store_true", help="run the surviving mutants again")
    ap.add_argument("--sample", type=int, default=0, help="run N mutants per module, chosen at random (seeded)")
    ap.add_argument("--fraction", type=float, default=1.0,
                    help="run this fraction of each module's mutants, chosen at random (seeded; default 1: all)")
    ap.add_argument("--seed", type=int, default=12)
    ap.add_argument("--one-call", action="store_true",
                    help="all the modules' mutants in one mutmut run: one clean-test pass instead of one per module "
                         "(the timing is then recorded for the group)")
    args = ap.parse_args(argv)
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown:
        print(f"error: unknown module(s) {', '.join(unknown)}; valid: {', '.join(MODULES)}", file=sys.stderr)
        return 2
    if not 0 < args.fraction <= 1:
        print(f"error: --fraction must be in (0, 1], got {args.fraction}", file=sys.stderr)
        return 2
    os.chdir(ROOT)
    _narrow_string_operator()
    # one torch thread per worker (tests/conftest.py): each mutant's tests run in a child forked from mutmut's
    # fork server, and a child that uses torch's OpenMP pool hangs until its timeout (seen with
    # --max-children 1 on 2 cores: 5 of the first 20 mutants, 0 s of CPU in 150 s); two workers with two
    # threads each would also wait on each other's spinning threads
    os.environ["HARNESS_MUTATION_THREADS"] = "1"
    if args.rerun_survivors:  # one mutmut run for all of them: one clean-test pass instead of one per module
        names = [n for module in args.modules for n in _survivors(module)] if (ROOT / "mutants").is_dir() else []
        return _timed_run(names, args.max_children, f"survivors of {len(args.modules)} modules (rerun)",
                          len(names)) if names else 0
    how = f"sample {args.sample}, seed {args.seed}" if args.sample else \
        f"fraction {args.fraction:g}, seed {args.seed}" if args.fraction < 1 else ""
    now = {module: _all_statuses(module) for module in args.modules}
    chosen = {module: _choose(module, sorted(now[module]), args.sample, args.fraction, args.seed)
              for module in args.modules}
    if how:
        sample_path = ROOT / "mutants" / "mutation-sample.json"
        samples = json.loads(sample_path.read_text()) if sample_path.is_file() else {}
        for module, names in chosen.items():
            samples[module] = sorted(set(samples.get(module, [])) | set(names))
        sample_path.write_text(json.dumps(samples, indent=1))
    groups = [(" + ".join(args.modules), args.modules)] if args.one_call else [(m, [m]) for m in args.modules]
    for key, modules in groups:
        # only mutants without a result: mutmut runs every mutant it is named again
        pending = [n for m in modules for n in chosen[m] if now[m][n] == "not checked"]
        if not pending:
            continue
        status = _timed_run(pending, args.max_children, f"{key} ({how})" if how else key, len(pending))
        if status:
            return status
    return 0


def _choose(module: str, names: list[str], sample: int, fraction: float, seed: int) -> list[str]:
    """The module's mutants this run is about: all, N of them or a fraction, chosen with a seeded generator."""
    k = min(sample, len(names)) if sample else max(1, math.ceil(fraction * len(names))) if fraction < 1 else 0
    return random.Random(f"{seed}:{module}").sample(names, k) if k else names


if __name__ == "__main__":
    sys.exit(main())
