"""python -m harness points: the capture points of an architecture (or of a model's), and what each holds."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

from ..architectures.registry import architecture_names, get_architecture
from ..checkpoints.loading import ModelDirError, open_checkpoint
from ..emulation.capture import DERIVED_POINTS
from ..plugins import PluginError, load_all

__all__ = ["points_main"]


def points_main(argv: list[str], out: Callable[[str], None], err: Callable[[str], None]) -> int:
    """List the points, one line each, through `out`; a bad --model, --architecture or --plugin is exit 2 with
    the reason through `err`."""
    parser = argparse.ArgumentParser(prog="python -m harness points",
                                     description="list the capture points (taps) and what each one holds")
    names = architecture_names()  # before --plugin loads: the built-in ones, listed first (the first: the default)
    parser.add_argument("--architecture", default=names[0],
                        help=f"the block architecture whose points to list (default {names[0]}; valid: the "
                             f"registered ones, {' '.join(names)} and the plugins')")
    parser.add_argument("--model", type=Path, default=None, help="list the points of this model's architecture")
    parser.add_argument("--plugin", action="append", default=[], metavar="FILE_OR_MODULE",
                        help="load a plugin first: a .py file or a dotted module name (repeatable; docs/plugins.md)")
    args = parser.parse_args(argv)
    try:
        load_all(args.plugin)
        arch = open_checkpoint(args.model).dims.architecture if args.model is not None else args.architecture
    except (PluginError, ModelDirError) as e:
        err(f"error: {e}")
        return 2
    if arch not in architecture_names():
        err(f"error: --architecture {arch}: unknown; valid: {', '.join(architecture_names())}")
        return 2
    for point, what in {**get_architecture(arch).points, **DERIVED_POINTS}.items():
        out(f"L<i>.{point:<16} {what}")
    return 0
