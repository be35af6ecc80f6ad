"""`modes` and `points`: what can be run and captured."""
from __future__ import annotations
from ..recipes.registry import architectures_of

import sys

__all__ = ["modes_main", "points_main"]


def modes_main(argv: list[str]) -> int:
    from tabulate import tabulate

    from ..modes import BUILTIN_MODES, KNOBS, MAMBA2_PRESETS, PRESETS
    from ..recipes.registry import architectures_of

    rows = [[r.name, r.title, *r.knobs().values(), " ".join(architectures_of(r))] for r in BUILTIN_MODES.values()]
    print(tabulate(rows, headers=["mode", "name", *KNOBS, "runs on"]))
    print("\npresets: " + "; ".join(f"{k} = {' '.join(v)}" for k, v in PRESETS.items()))
    print("on a Mamba-2 model: " + "; ".join(f"{k} = {' '.join(v) or '(none)'}" for k, v in MAMBA2_PRESETS.items()))
    return 0


def points_main(argv: list[str]) -> int:
    from ..runner.points import points_main

    return points_main(argv, lambda line: print(line), lambda line: print(line, file=sys.stderr))
