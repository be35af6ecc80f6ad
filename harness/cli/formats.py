"""`python -m harness formats`: the number formats; with FILE.npz the sweep of every captured tensor over
them (report.formats); with --suggest BUDGET a per-layer format assignment (runner.suggest)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .options import add_plugin_option, plugins_loaded

__all__ = ["formats_main", "build_formats_parser", "build_sweep_parser"]

_SUGGEST_ONLY = ("model", "seq_len", "output")


def formats_main(argv: list[str]) -> int:
    """The command with SIGINT/SIGTERM turned into a clean exit (130/143, no traceback, nothing half-written)."""
    from ..runtime.guard import Interrupted, handle_signals

    try:
        with handle_signals():
            args = build_formats_parser("python -m harness formats").parse_args(argv)
            if not plugins_loaded(args.plugin):
                return 2
            return _suggest_main(args) if args.suggest is not None else _sweep_main(args)
    except Interrupted as e:
        print(f"interrupted by {e.name}; nothing was written", file=sys.stderr)
        return e.exit_code


def build_formats_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """Both forms of the command: the sweep (no FILE: the list) and --suggest BUDGET."""
    from ..runner.suggest import DEFAULT_LADDER

    p = argparse.ArgumentParser(prog=prog, description="Without FILE: list the number formats. With FILE: the "
                                "error of every captured tensor in each format (MSE, rel L2, SQNR, max |err|, "
                                "overflow / underflow / saturated fractions, blocks whose scale one outlier set). "
                                "With --suggest BUDGET: the cheapest per-layer formats whose end-to-end KL stays "
                                "within BUDGET (a sensitivity study per format, then one verifying run).")
    p.add_argument("file", type=Path, nargs="?", default=None, help="capture .npz (this harness's or the research tool's)")
    p.add_argument("--formats", nargs="+", default=None, help="sweep only these formats (default: all); with "
                   f"--suggest, the candidates (default: {' '.join(DEFAULT_LADDER)})")
    for name, what in (("modes", "modes (default: all)"), ("tensors", "tensors, e.g. output L0.ssm.u (default: all)")):
        p.add_argument(f"--{name}", nargs="+", default=None, help=f"sweep only these {what}")
    p.add_argument("--json", type=Path, default=None, help="write the sweep to this JSON file ('-': standard output)")
    g = p.add_argument_group("per-layer suggestion (--suggest BUDGET; takes no FILE)")
    g.add_argument("--suggest", type=float, default=None, metavar="BUDGET", help="end-to-end KL budget (nats, >= 0)")
    g.add_argument("--model", type=Path, default=None, help="float model directory (default: the shipped one)")
    g.add_argument("--seq_len", "--seq-len", dest="seq_len", type=int, default=None, help="tokens (default 512)")
    g.add_argument("--output", type=Path, default=None, help="the modes file to write (default: "
                   "suggested_modes.json; an existing file is replaced only if it is a previous suggestion)")
    add_plugin_option(p)
    return p


build_sweep_parser = build_formats_parser  # its earlier name


def _sweep_main(args: argparse.Namespace) -> int:
    from ..report.formats import SweepError, format_table, sweep_file, sweep_tables
    from ..store.format import StorageError, check_json_output, json_text, write_json

    given = [f"--{n}" for n in _SUGGEST_ONLY if getattr(args, n) is not None]
    if given:
        print(f"error: {', '.join(given)} only apply with --suggest BUDGET", file=sys.stderr)
        return 2
    if args.file is None:
        if args.modes or args.tensors or args.json:
            print("error: --modes, --tensors and --json need a capture FILE", file=sys.stderr)
            return 2
        print(format_table())
        return 0
    to_stdout = args.json is not None and str(args.json) == "-"
    try:
        if args.json is not None and not to_stdout:
            check_json_output(args.json, {"the capture": args.file})
        result = sweep_file(args.file, args.formats, args.modes, args.tensors)
    except (StorageError, SweepError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if to_stdout:
        print(json_text(result, indent=1))
        return 0
    print(sweep_tables(result))
    if args.json is not None:
        write_json(args.json, result)
        print(f"\nwrote {args.json}")
    return 0


def _suggest_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the options of --suggest (checked before any work), or None."""
    from ..kernels.formats import FORMATS

    bad = [f for f in args.formats or [] if f not in FORMATS]
    if bad:
        return f"--formats {' '.join(bad)} unknown (valid: {', '.join(FORMATS)})"
    if args.file is not None or args.modes or args.tensors or args.json is not None:
        return "--suggest takes no capture FILE, --modes, --tensors or --json (it runs the model itself)"
    if not args.suggest >= 0 or args.suggest == float("inf"):
        return f"--suggest needs a finite KL budget >= 0 (nats), got {args.suggest}"
    if args.seq_len is not None and args.seq_len < 1:
        return f"--seq_len must be a positive integer, got {args.seq_len}"
    return None


def _suggest_main(args: argparse.Namespace) -> int:
    from ..runner.pipeline import InputError
    from ..runner.suggest import DEFAULT_LADDER, SUGGESTED, check_suggestion_output, suggest
    from ..store.format import write_json

    problem = _suggest_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    output = args.output or Path("suggested_modes.json")
    try:
        check_suggestion_output(output, args.model)
        result = suggest(args.model, args.formats or list(DEFAULT_LADDER), args.suggest,
                         seq_len=args.seq_len or 512, emit=print)
    except InputError as e:  # a tuple of the runner's input errors (ModeError, StorageError among them)
        print(f"error: formats --suggest: {e}", file=sys.stderr)
        return 2
    write_json(output, result["modes"])
    for i, f in result["assignment"].items():
        print(f"block {i}: {f}  (KL alone: {result['kl_by_format'][f][i]:.3g})")
    print(f"mean bits/value {result['bits']:.2f}; verified end-to-end KL {result['verified_kl']:.4g} "
          f"({'within' if result['within_budget'] else 'OVER'} the budget {args.suggest})")
    print(f"wrote {output} (run it: --modes fp32 {SUGGESTED} --modes_file {output})")
    return 0
