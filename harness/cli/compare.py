"""`compare` (compare_with_fp.py): every mode of a capture against a reference, or two runs (--against)."""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from .guard import guarded
from .options import add_plugin_option, opt, plugins_loaded

__all__ = ["build_compare_parser", "compare_main"]


def build_compare_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Compare every mode of a capture file against a reference "
                                "mode: MSE, MAE, RMSE, max|err|, relative L2, SQNR, cosine, Pearson, |err| percentiles.")
    p.add_argument("file", type=Path, help="capture .npz (this harness's or the research tool's)")
    opt(p, "reference", default="fp32", help="reference mode (default: fp32)")
    opt(p, "json", type=Path, default=None, help="write all metrics to this JSON file")
    opt(p, "save_comparison", type=Path, default=None, help="research-tool name of --json")
    opt(p, "modes", nargs="+", default=None, help="compare only these modes")
    opt(p, "tensors", nargs="+", default=None, help="compare only these tensors (e.g. output L0.ssm.u)")
    opt(p, "fail-if", default=None, metavar="EXPR",
         help="exit 1 if EXPR holds for any mode and tensor, e.g. \"tensor == 'output' and sqnr_db < 20\"")
    opt(p, "against", type=Path, default=None, help="compare the same modes of FILE against this run (docs/decode.md)")
    for tol in ("atol", "rtol"): opt(p, tol, type=float, default=0.0, help=f"with --against: {tol} (default: 0)")
    add_plugin_option(p)
    return p


def compare_main(argv: list[str] | None = None, prog: str | None = None) -> int:
    return guarded(_compare, argv, prog)


def _compare(argv: list[str] | None, prog: str | None, progress) -> int:
    progress.phase = "comparing"
    args = build_compare_parser(prog).parse_args(argv)
    if not plugins_loaded(args.plugin):
        return 2
    if args.against is not None:  # two runs of the same modes (runner.crossrun, docs/decode.md)
        return importlib.import_module("harness.runner.crossrun").command(args, print)
    from ..metrics.compare import CompareError, compare_modes, compared_pairs, fail_if_violations, same_basis
    from ..report.compare_text import compare_output, gate_line
    from ..store.format import StorageError, check_json_output, stats_path, write_json
    from ..store.reader import load_capture

    out = args.json or args.save_comparison
    try:
        if out is not None:
            check_json_output(out, {"the capture": args.file})
        if args.fail_if is not None:
            fail_if_violations(args.fail_if, {"modes": {}})  # a bad expression is exit 2 before any work
        cf = load_capture(args.file)
        if (cf.manifest or {}).get("stats_only"):
            raise StorageError(f"{args.file} was written with --stats-only and holds no arrays; "
                               f"its statistics and comparison are in {stats_path(args.file)}")
        for what, asked, present in (("--modes", args.modes, cf.modes()),
                                     ("--tensors", args.tensors, sorted({t for m in cf.modes() for t in cf.tensors(m)}))):
            unknown = [x for x in asked or [] if x not in present]
            if unknown:
                raise CompareError(f"{what} {' '.join(unknown)} matches nothing in {args.file}; "
                                   f"present: {', '.join(present) or 'none'}")
        tensors = {m: [t for t in cf.tensors(m) if args.tensors is None or t in args.tensors]
                   for m in cf.modes() if args.modes is None or m in args.modes or m == args.reference}
        comparable = same_basis(lambda m, t: cf.tensor_meta(m, t).get("basis"), args.reference) if cf.manifest else None
        comparison = compare_modes(tensors, cf.array, args.reference, comparable)
        hits = fail_if_violations(args.fail_if, comparison) if args.fail_if else []
    except (StorageError, CompareError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text, failed_text = compare_output(comparison, cf.manifest or {}, tensors, args.reference, args.modes, args.tensors)
    print(f"{args.file}: {len(tensors)} modes" + ("" if cf.manifest else " (research-tool file, no manifest)")
          + ("; logits not stored (--no-logits)" if (cf.manifest or {}).get("logits_stored") is False else ""))
    print(text)
    if failed_text:
        print("\n".join(failed_text), file=sys.stderr)
    if out is not None:
        write_json(out, comparison)
        print(f"\nwrote {out}")
    if compared_pairs(comparison) == 0:
        print(f"\nnothing was compared: no mode shares a comparable tensor with {args.reference}", file=sys.stderr)
        if args.fail_if:
            return 1
    if hits:
        print(f"\n--fail-if {args.fail_if!r} holds (or compares a NaN metric) for: "
              + ", ".join(f"{m} {t}" for m, t in hits), file=sys.stderr)
    if args.fail_if and comparison["failed_modes"]:  # a mode in error is never a pass
        print(gate_line(comparison["failed_modes"]), file=sys.stderr)
    return 1 if hits or (args.fail_if and comparison["failed_modes"]) else 0
