"""`python -m harness COMMAND`: the dispatch, and the imports each command needs before it runs."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

from .capture import capture_main
from .compare import compare_main
from .evaluate import eval_main
from .export import export_main
from .formats import formats_main
from .guard import guarded
from .listing import modes_main, points_main

__all__ = ["main", "preload", "report_main"]


def report_main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """The report command; matplotlib is imported only when a report is asked for."""
    from ..report.build import report_main

    def compare(a: Path, b: Path, atol: float, rtol: float) -> dict:   # report --against (the runner ranks above the report)
        from ..runner.crossrun import compare_files
        return compare_files(a, b, atol=atol, rtol=rtol)

    return guarded(lambda args, name, _progress: report_main(args, name, compare), argv, prog)


_USAGE = """usage: python -m harness COMMAND [options]   (python -m harness COMMAND --help for its options)

commands:
  capture   run modes on a model and write the .npz + _stats.json pair (save_first_layer_io.py)
  compare   compare every mode of a capture against the reference (compare_with_fp.py)
  report    write the HTML report of a capture
  export    calibrate and write a Quamba W8A8 checkpoint
  eval      every mode on lm-evaluation-harness tasks, paired with the reference (NAME_eval.json)
  modes     list the built-in modes with their knobs, and the presets
  points    list the capture points (taps) and what each one holds
  formats   list the number formats; with FILE.npz, the error of every captured tensor in each format;
            with --suggest BUDGET, the cheapest per-layer formats within an end-to-end KL budget"""


# the modules a command imports when it runs (torch with them): the entry points load them while the
# start-up handler still leaves quietly (harness.runtime.startup), never under the run's own handlers,
# where a signal raised inside torch's import could abort the process
_HEAVY = {"capture": "harness.runner.pipeline", "export": "harness.runner.export", "report": "harness.report.build",
          "formats": "harness.report.formats", "eval": "harness.runner.pipeline"}  # (formats --suggest imports the runner when it starts)


def preload(command: str | None) -> None:
    """Import what `command` (capture, export, report, ...) will need; nothing for the light commands."""
    if command in _HEAVY:
        importlib.import_module(_HEAVY[command])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"capture": capture_main, "compare": compare_main, "export": export_main, "report": report_main,
                "modes": modes_main, "points": points_main, "formats": formats_main, "eval": eval_main}
    if argv[:1] in (["-h"], ["--help"]):
        print(_USAGE)
        return 0
    if not argv or argv[0] not in commands:
        if argv:
            print(f"error: unknown command {argv[0]!r}; valid: {', '.join(commands)}", file=sys.stderr)
        print(_USAGE, file=sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    if name in ("capture", "compare", "export", "report", "eval"):
        return commands[name](rest, prog=f"python -m harness {name}")
    return commands[name](rest)
