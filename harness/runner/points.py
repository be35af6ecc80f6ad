"""python -m harness points: the capture points of an architecture (or of a model's), and what each holds."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

from ..architectures.registry import architecture_names, get_architecture
from ..checkpoints.loading import ModelDirError, open_checkpoint
from ..emulation.capture import DERIVED_POINTS
from ..plugins import PluginError, load_all
from ..recipes.registry import checkpoint_formats

__all__ = ["points_main"]


def _architecture_of(model: Path) -> str:
    """The architecture of a model directory, opened as runner.pairing.open_models does: through the registered
    checkpoint format that detects it (a Quamba1 or Quamba2 checkpoint), else as a float checkpoint."""
    fmt = next((f for f in checkpoint_formats() if f.detect(model)), None)
    return (fmt.open(model) if fmt is not None else open_checkpoint(model)).dims.architecture


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
        arch = _architecture_of(args.model) if args.model is not None else args.architecture
    except (PluginError, ModelDirError) as e:
        err(f"error: {e}")
        return 2
    if arch not in architecture_names():
        err(f"error: --architecture {arch}: unknown; valid: {', '.join(architecture_names())}")
        return 2
    for point, what in {**get_architecture(arch).points, **DERIVED_POINTS}.items():
        out(f"L<i>.{point:<16} {what}")
    return 0
