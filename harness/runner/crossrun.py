"""``compare A.npz --against B.npz``: the same modes of two capture files (our emulation against a GPU dump, two
versions of a model, two machines), through ``metrics.crossrun``. Files whose token ids differ are refused.

Python API: ``compare_files(a, b, atol=..., rtol=..., modes=...)`` returns metrics.crossrun.compare_runs's dict.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

import numpy as np

from ..metrics.crossrun import compare_runs
from ..runtime.log import error
from ..store.reader import CaptureFile, load_capture
from ..store.format import StorageError, check_json_output, write_json

__all__ = ["CrossRunError", "compare_files", "crossrun_text", "command"]


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
    result = compare_runs(chosen, ca.array, cb.array, atol=atol, rtol=rtol)
    result.update(a=str(a), b=str(b))
    return result


def crossrun_text(result: dict) -> str:
    """Per mode: the first differing tensor, then one line per tensor (equal, max|err|, relative L2)."""
    lines = [f"{result['a']} against {result['b']} (atol {result['atol']}, rtol {result['rtol']})"]
    for mode, entry in result["modes"].items():
        first = entry["first_differing"]
        where = "none: every common tensor is within tolerance" if first is None else \
            first["tensor"] + ("" if first["step"] is None else f" at decode step {first['step']}")
        lines += ["", f"mode {mode}: first differing tensor: {where}",
                  f"  {'tensor':<28} {'equal':<6} {'max|err|':>12} {'rel L2':>12}"]
        for tensor, row in entry["tensors"].items():
            lines.append(f"  {tensor:<28} {'yes' if row['equal'] else 'no':<6} {row['max_abs']:>12.6g} "
                         f"{row['rel_l2']:>12.6g}")
        for tensor, why in entry["skipped"].items():
            lines.append(f"  {tensor:<28} skipped: {why}")
    return "\n".join(lines)


def command(args: argparse.Namespace, emit: Callable[[str], None]) -> int:
    """The compare command with --against: 0 when compared, 2 on bad input."""
    out = args.json or args.save_comparison
    try:
        if out is not None:
            check_json_output(out, {"the capture": args.file, "the --against capture": args.against})
        result = compare_files(args.file, args.against, atol=args.atol, rtol=args.rtol, modes=args.modes)
    except (StorageError, CrossRunError) as e:
        error(str(e))
        return 2
    emit(crossrun_text(result))
    if out is not None:
        write_json(out, result)
        emit(f"\nwrote {out}")
    return 0
