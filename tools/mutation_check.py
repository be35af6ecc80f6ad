"""Check a surviving mutant by hand: apply it to the source, run the given tests, restore the source.

    python tools/mutation_check.py MUTANT [PYTEST ARGS ...]     # e.g. tests/architectures/mamba1/test_prep_and_state.py -k release
    python tools/mutation_check.py --tested                     # every survivor with a [tested] verdict

Prints "killed" (the tests fail with the mutant) or "SURVIVED", and exits 0 or 1. Needs a `make mutation`
run before it (mutants/ holds the mutants). --tested checks each mutant that mutmut reports surviving and
that tools/mutation_verdicts.toml says a test was added for, with that test, and writes the outcome to
mutants/mutation-checked.json, which tools/mutation_report.py reads: mutmut runs, per mutant, only the
tests its call statistics associate with the function, and they miss some (a function reached from a
module-scoped fixture set up by another test); a test added for a survivor may also postdate the run.

Why not `mutmut apply`: it writes the mutant over the first function of that name in the file, so a
mutant of `Class.forward` or `Class.__init__` lands in another class's method when the file has several.
Here the mutant's diff (`mutmut show`) is applied inside its own class and function, each changed line
keeping the indentation it has in the file. The source file is restored whatever happens.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _diff(name: str) -> tuple[str, list[str]]:
    """(source path, hunk lines) of the mutant's diff against its function."""
    shown = subprocess.run([sys.executable, "-m", "mutmut", "show", name], capture_output=True, text=True,
                           cwd=ROOT, check=True).stdout.splitlines()
    path = next(line[4:].strip() for line in shown if line.startswith("--- "))
    start = next(i for i, line in enumerate(shown) if line.startswith("@@"))
    return path, [line for line in shown[start + 1:] if line[:1] in (" ", "-", "+")]


def _function_span(src: list[str], name: str) -> tuple[int, int]:
    """[first, end) lines of the mutated function (a method inside its own class)."""
    func = name.rsplit(".", 1)[1].split("__mutmut_")[0]
    first = 0
    if "ǁ" in func:
        _, cls, func = func.split("ǁ")
        first = next(i for i, line in enumerate(src) if re.match(rf"class {re.escape(cls)}\b", line))
    else:
        func = func.removeprefix("x_")
    d = next(i for i in range(first, len(src)) if re.match(rf"\s*def {re.escape(func)}\(", src[i]))
    indent = len(src[d]) - len(src[d].lstrip())
    end = next((i for i in range(d + 1, len(src)) if src[i].strip() and len(src[i]) - len(src[i].lstrip()) <= indent
                and not src[i].lstrip().startswith((")", "]", "}"))), len(src))
    return d, end


def apply(name: str) -> tuple[Path, str]:
    """Write the mutant into its source file; returns (file, original text)."""
    path, hunk = _diff(name)
    file = ROOT / path
    original = file.read_text()
    src = original.splitlines()
    old = [line[1:] for line in hunk if line[:1] in (" ", "-")]
    removed = [k for k, line in enumerate(line for line in hunk if line[:1] in (" ", "-")) if line[:1] == "-"]
    added = [line[1:] for line in hunk if line[:1] == "+"]
    first, end = _function_span(src, name)
    hits = [i for i in range(first, end - len(old) + 1)
            if [s.strip() for s in src[i:i + len(old)]] == [s.strip() for s in old]]
    if len(hits) != 1:
        raise SystemExit(f"error: {name}: its lines were found {len(hits)} times in {path}, expected once")
    block = src[hits[0]:hits[0] + len(old)]
    if len(removed) == len(added):  # line for line (string literals such as docstrings keep their own indentation)
        for k, text in zip(removed, added):
            rel = (len(text) - len(text.lstrip())) - (len(old[k]) - len(old[k].lstrip()))
            block[k] = block[k][:len(block[k]) - len(block[k].lstrip())] + " " * max(rel, 0) + text.lstrip()
    else:  # mutmut's diff is of the function dedented to column 0: indent it as the def line is
        indent = " " * (len(src[first]) - len(src[first].lstrip()))
        block = [(indent + line[1:]) if line[1:].strip() else line[1:] for line in hunk if line[:1] in (" ", "+")]
    src[hits[0]:hits[0] + len(old)] = block
    file.write_text("\n".join(src) + ("\n" if original.endswith("\n") else ""))
    return file, original


def check(name: str, tests: list[str]) -> bool:
    """True when the tests fail with the mutant applied."""
    file, original = apply(name)
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests], cwd=ROOT,
                           capture_output=True, text=True)
    finally:
        file.write_text(original)
    last = (r.stdout.strip().splitlines() or [""])[-1]
    print(f"{name}: {'killed' if r.returncode != 0 else 'SURVIVED'} ({last})", flush=True)
    return r.returncode != 0


def check_tested() -> int:
    import json
    import tomllib

    sys.path.insert(0, str(ROOT / "tools"))
    from mutation import MODULES, statuses
    tested = tomllib.loads((ROOT / "tools" / "mutation_verdicts.toml").read_text()).get("tested", {})
    surviving = {k for m in MODULES for k, s in (statuses(m) or {}).items() if s in ("survived", "no tests")}
    out = ROOT / "mutants" / "mutation-checked.json"
    checked = json.loads(out.read_text()) if out.is_file() else {}
    for name in sorted(surviving & set(tested)):
        test = tested[name].split()[0]  # the verdict's test id (a note may follow)
        checked[name] = {"test": test, "killed": check(name, [test])}
        out.write_text(json.dumps(checked, indent=1, ensure_ascii=False) + "\n")
    return 0 if all(c["killed"] for c in checked.values()) else 1


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    if argv == ["--tested"]:
        return check_tested()
    return 0 if check(argv[0], argv[1:] or ["tests/"]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
