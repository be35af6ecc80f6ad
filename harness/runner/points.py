"""python -m harness points: the capture points of an architecture (or of a model's), and what each holds."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

from ..checkpoints.loading import ModelDirError, open_checkpoint
from ..emulation.capture import DERIVED_POINTS, SITE_TABLES

__all__ = ["points_main"]


def points_main(argv: list[str], out: Callable[[str], None], err: Callable[[str], None]) -> int:
    """List the points, one line each, through `out`; a bad --model is exit 2 with the reason through `err`."""
    parser = argparse.ArgumentParser(prog="python -m harness points",
                                     description="list the capture points (taps) and what each one holds")
    parser.add_argument("--architecture", choices=list(SITE_TABLES), default="mamba1",
                        help="the block architecture whose points to list (default mamba1)")
    parser.add_argument("--model", type=Path, default=None, help="list the points of this model's architecture")
    args = parser.parse_args(argv)
    arch = args.architecture
    if args.model is not None:
        try:
            arch = open_checkpoint(args.model).dims.architecture
        except ModelDirError as e:
            err(f"error: {e}")
            return 2
    for point, what in {**SITE_TABLES[arch], **DERIVED_POINTS}.items():
        out(f"L<i>.{point:<16} {what}")
    return 0
