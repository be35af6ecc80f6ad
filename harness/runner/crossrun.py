"""``compare A.npz --against B.npz``: the same modes of two capture files (our emulation against a GPU dump, two
versions of a model, two machines), through ``metrics.crossrun``. Files whose token ids differ are refused.
A tensor whose recorded basis (``--basis``) differs between the files is skipped, and runs captured with
different ``--basis`` are named in a warning. ``--fail-if`` applies to every compared (mode, tensor) row
(``identical``: the two runs' values are equal); a common tensor that was skipped fails it (not compared is
never a pass).

Python API: ``compare_files(a, b, atol=..., rtol=..., modes=...)`` returns metrics.crossrun.compare_runs's dict.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

import numpy as np

from ..metrics.compare import CompareError, fail_if_violations
from ..metrics.crossrun import compare_runs, no_difference_text
from ..runtime.log import error, warn
from ..store.reader import CaptureFile, load_capture
from ..store.format import StorageError, check_json_output, write_json

__all__ = ["CrossRunError", "compare_files", "crossrun_text", "fail_if_hits", "command"]


class CrossRunError(ValueError):
    """The two files cannot be compared (different token ids, no common mode)."""


def _token_ids(cf: CaptureFile) -> np.ndarray | None:
    return np.asarray(cf.npz["token_ids"]) if "token_ids" in cf.npz.files else None


def compare_files(a: Path, b: Path, *, atol: float = 0.0, rtol: float = 0.0, modes: list[str] | None = None) -> dict:
    """Every mode both files hold (or `modes`): metrics per tensor of A against B and the first bad tensor."""
    if atol < 0 or rtol < 0 or not np.isfinite(atol) or not np.isfinite(rtol):
        raise CrossRunError(f"--atol and --rtol must be finite and >= 0, got {atol} and {rtol}")
    ca, cb = load_capture(a), load_capture(b)
    ids_a, ids_b = _token_ids(ca), _token_ids(cb)
    if ids_a is None or ids_b is None:
        raise CrossRunError(f"{a if ids_a is None else b} has no token_ids: the two runs cannot be shown to have "
                            "seen the same tokens")
    if ids_a.shape != ids_b.shape or not np.array_equal(ids_a, ids_b):
        where = "shape" if ids_a.shape != ids_b.shape else f"first at position {int(np.flatnonzero(ids_a.ravel() != ids_b.ravel())[0])}"
        raise CrossRunError(f"the token ids differ ({where}: {a} has {list(ids_a.shape)}, {b} has "
                            f"{list(ids_b.shape)}): the runs saw different text; capture both with the same "
                            "--text_file, --seq_len and --decode")
    common = [m for m in ca.modes() if m in cb.modes()]
    unknown = [m for m in modes or [] if m not in common]
    if unknown or not common:
        raise CrossRunError(f"mode(s) {', '.join(unknown) or '(any)'} not in both files; modes in both: "
                            f"{', '.join(common) or 'none'}")
    chosen = {m: (ca.tensors(m), cb.tensors(m)) for m in common if modes is None or m in modes}
    result = compare_runs(chosen, ca.array, cb.array, atol=atol, rtol=rtol, comparable=_same_basis(ca, cb))
    result.update(a=str(a), b=str(b), warnings=_basis_warnings(ca, cb))
    return result


def _run_basis(cf: CaptureFile) -> str | None:
    """The --basis a capture was run with (its stats' provenance), None when not recorded (no manifest)."""
    return ((cf.manifest or {}).get("provenance") or {}).get("basis")


def _same_basis(ca: CaptureFile, cb: CaptureFile) -> Callable[[str, str], str | None]:
    """compare_runs's `comparable`: a tensor whose recorded bases differ is skipped (values in two bases)."""
    def check(mode: str, tensor: str) -> str | None:
        ba, bb = ca.tensor_meta(mode, tensor).get("basis"), cb.tensor_meta(mode, tensor).get("basis")
        return None if ba is None or bb is None or ba == bb else f"basis differs ({ba} in A, {bb} in B)"
    return check


def _basis_warnings(ca: CaptureFile, cb: CaptureFile) -> list[str]:
    ba, bb = _run_basis(ca), _run_basis(cb)
    if ba is None or bb is None or ba == bb:
        return []
    return [f"the runs were captured in different bases (A --basis {ba}, B --basis {bb}): tensors whose recorded "
            "bases differ are skipped; capture both with the same --basis to compare them"]


def crossrun_text(result: dict) -> str:
    """Per mode: the first differing tensor, then one line per tensor (equal, max|err|, relative L2)."""
    lines = [f"{result['a']} against {result['b']} (atol {result['atol']}, rtol {result['rtol']})"]
    lines += [f"warning: {w}" for w in result.get("warnings", [])]
    for mode, entry in result["modes"].items():
        first = entry["first_differing"]
        where = no_difference_text(entry) if first is None else \
            first["tensor"] + ("" if first["step"] is None else f" at decode step {first['step']}")
        lines += ["", f"mode {mode}: first differing tensor: {where}",
                  f"  {'tensor':<28} {'equal':<6} {'max|err|':>12} {'rel L2':>12}"]
        for tensor, row in entry["tensors"].items():
            lines.append(f"  {tensor:<28} {'yes' if row['equal'] else 'no':<6} {row['max_abs']:>12.6g} "
                         f"{row['rel_l2']:>12.6g}")
        for tensor, why in entry["skipped"].items():
            lines.append(f"  {tensor:<28} skipped: {why}")
    return "\n".join(lines)


def fail_if_hits(expr: str, result: dict) -> list[tuple[str, str]]:
    """(mode, tensor) pairs that fail --fail-if EXPR: every compared row where EXPR holds or is unknown
    (``identical``: the row's values are equal in both runs), then every skipped common tensor."""
    rows = {m: {t: {**row, "identical": row["equal"]} for t, row in e["tensors"].items()}
            for m, e in result["modes"].items()}
    hits = fail_if_violations(expr, {"modes": rows})
    return hits + [(m, t) for m, e in result["modes"].items() for t in e["skipped"]]


def command(args: argparse.Namespace, emit: Callable[[str], None]) -> int:
    """The compare command with --against: 0 when compared (and --fail-if never held), 1 when --fail-if held
    or a common tensor could not be compared under it, 2 on bad input."""
    out = args.json or args.save_comparison
    try:
        if out is not None:
            check_json_output(out, {"the capture": args.file, "the --against capture": args.against})
        if args.fail_if is not None:
            fail_if_violations(args.fail_if, {"modes": {}})  # a bad expression is exit 2 before any work
        result = compare_files(args.file, args.against, atol=args.atol, rtol=args.rtol, modes=args.modes)
        hits = fail_if_hits(args.fail_if, result) if args.fail_if is not None else []
    except (StorageError, CrossRunError, CompareError) as e:
        error(str(e))
        return 2
    emit(crossrun_text(result))
    for w in result["warnings"]:
        warn(w)
    if out is not None:
        write_json(out, result)
        emit(f"\nwrote {out}")
    if hits:
        error(f"--fail-if {args.fail_if!r} holds (or compares a NaN metric, or the tensor was skipped) for: "
              + ", ".join(f"{m} {t}" for m, t in hits))
    return 1 if hits else 0
