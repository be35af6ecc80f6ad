"""`capture` (save_first_layer_io.py): run modes, write the pair, and the report when asked."""
from __future__ import annotations

import sys
from pathlib import Path

from .guard import guarded
from .options import build_capture_parser, config_from_args

__all__ = ["capture_main", "build_capture_parser"]


def capture_main(argv: list[str] | None = None, prog: str | None = None) -> int:
    return guarded(_capture, argv, prog)


def _capture(argv: list[str] | None, prog: str | None, progress) -> int:
    args = build_capture_parser(prog).parse_args(argv)
    from ..runner.pipeline import InputError, run

    try:
        outcome = run(config_from_args(args), emit=(lambda _s: None) if args.quiet else print,
                      progress=progress.silenced(args.quiet))
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.quiet:
        print(args.output_file)
    if args.report and _write_report(args.output_file, args.reference) != 0:
        return 2
    return 1 if outcome.failed else 0


def _write_report(npz: Path, reference: str) -> int:
    """capture --report: the HTML report of the file just written (harness.report); without the
    reference mode (not run, or failed) the report has no comparison, as the capture's output."""
    from ..report.build import write_report
    from ..store.format import StorageError

    try:
        out = write_report(npz, reference=reference, require_reference=False)
    except StorageError as e:
        print(f"error: report: {e}", file=sys.stderr)
        return 2
    print(f"wrote report {out}")
    return 0
