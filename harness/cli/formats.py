"""`python -m harness formats`: the number formats; with FILE.npz the sweep of every captured tensor over
them (report.formats); with --suggest BUDGET a per-layer format assignment (runner.suggest)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .options import add_plugin_option, plugins_loaded

__all__ = ["formats_main", "build_sweep_parser"]


def formats_main(argv: list[str]) -> int:
    """The command with SIGINT/SIGTERM turned into a clean exit (130/143, no traceback, nothing half-written)."""
    from ..runtime.guard import Interrupted, handle_signals

    try:
        with handle_signals():
            return _suggest_main(argv) if "--suggest" in argv else _sweep_main(argv, "python -m harness formats")
    except Interrupted as e:
        print(f"interrupted by {e.name}; nothing was written", file=sys.stderr)
        return e.exit_code


def build_sweep_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Without FILE: list the number formats. With FILE: the "
                                "error of every captured tensor in each format (MSE, rel L2, SQNR, max |err|, "
                                "overflow / underflow / saturated fractions, blocks whose scale one outlier set).")
    p.add_argument("file", type=Path, nargs="?", default=None, help="capture .npz (this harness's or the research tool's)")
    for name, what in (("formats", "formats (default: all)"), ("modes", "modes (default: all)"),
                       ("tensors", "tensors, e.g. output L0.ssm.u (default: all)")):
        p.add_argument(f"--{name}", nargs="+", default=None, help=f"sweep only these {what}")
    p.add_argument("--json", type=Path, default=None, help="write the sweep to this JSON file ('-': standard output)")
    add_plugin_option(p)
    return p


def _sweep_main(argv: list[str] | None = None, prog: str | None = None) -> int:
    from ..report.formats import SweepError, format_table, sweep_file, sweep_tables
    from ..store.format import StorageError, check_json_output, json_text, write_json

    args = build_sweep_parser(prog).parse_args(argv)
    if not plugins_loaded(args.plugin):
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


def _suggest_parser(prog: str) -> argparse.ArgumentParser:
    from ..runner.suggest import DEFAULT_LADDER

    p = argparse.ArgumentParser(prog=prog, description="Propose the cheapest per-layer formats whose end-to-end KL "
                                "stays within BUDGET (a sensitivity study per format, then one verifying run).")
    p.add_argument("--suggest", type=float, required=True, metavar="BUDGET", help="end-to-end KL budget (nats)")
    p.add_argument("--model", type=Path, default=None, help="float model directory (default: the shipped one)")
    p.add_argument("--formats", nargs="+", default=list(DEFAULT_LADDER), help="candidate formats")
    p.add_argument("--seq_len", "--seq-len", dest="seq_len", type=int, default=512, help="tokens (default 512)")
    p.add_argument("--output", type=Path, default=Path("suggested_modes.json"), help="the modes file to write")
    add_plugin_option(p)
    return p


def _suggest_main(argv: list[str], prog: str = "python -m harness formats") -> int:
    from ..kernels.formats import FORMATS
    from ..modes import ModeError
    from ..runner.pipeline import InputError
    from ..runner.suggest import SUGGESTED, suggest
    from ..store.format import StorageError, check_output, write_json

    args = _suggest_parser(prog).parse_args(argv)
    if not plugins_loaded(args.plugin):
        return 2
    bad = [f for f in args.formats if f not in FORMATS]
    if bad or not args.suggest >= 0 or args.seq_len < 1:
        print(f"error: --formats {' '.join(bad)} unknown (valid: {', '.join(FORMATS)})" if bad else
              "error: --suggest needs a KL budget >= 0 and --seq_len a positive integer", file=sys.stderr)
        return 2
    try:
        check_output(args.output)
        result = suggest(args.model, args.formats, args.suggest, seq_len=args.seq_len, emit=print)
    except (InputError, ModeError, StorageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_json(args.output, result["modes"])
    for i, f in result["assignment"].items():
        print(f"block {i}: {f}  (KL alone: {result['kl_by_format'][f][i]:.3g})")
    print(f"mean bits/value {result['bits']:.2f}; verified end-to-end KL {result['verified_kl']:.4g} "
          f"({'within' if result['within_budget'] else 'OVER'} the budget {args.suggest})")
    print(f"wrote {args.output} (run it: --modes fp32 {SUGGESTED} --modes_file {args.output})")
    return 0
