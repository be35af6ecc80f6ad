"""`modes` and `points`: what can be run and captured (the built-in names and the plugins')."""
from __future__ import annotations

import argparse
import sys

from .options import add_plugin_option, plugins_loaded

__all__ = ["modes_main", "points_main"]


def _modes_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harness modes", description="list the modes (built-in and the "
                                "plugins') with their knobs, recipe family and architectures, and the presets")
    add_plugin_option(p)
    return p


def modes_main(argv: list[str]) -> int:
    args = _modes_parser().parse_args(argv)
    if not plugins_loaded(args.plugin):
        return 2
    from tabulate import tabulate

    from ..modes import KNOBS, MAMBA2_PRESETS, PRESETS
    from ..recipes.registry import architectures_of, get_mode, get_recipe, list_modes, recipe_for, recipe_names

    rows = []
    for name in list_modes():
        r = get_mode(name)
        family, runs = recipe_for(r).name, " ".join(architectures_of(r))
        rows.append([r.name, r.title, *(getattr(r, k) for k in KNOBS), family, runs])
    print(tabulate(rows, headers=["mode", "name", *KNOBS, "family", "runs on"]))
    print("\nrecipe families: " + "; ".join(f"{n} ({get_recipe(n).title})" for n in recipe_names()))
    print("presets: " + "; ".join(f"{k} = {' '.join(v)}" for k, v in PRESETS.items()))
    print("on a Mamba-2 model: " + "; ".join(f"{k} = {' '.join(v) or '(none)'}" for k, v in MAMBA2_PRESETS.items()))
    return 0


def points_main(argv: list[str]) -> int:
    from ..runner.points import points_main

    return points_main(argv, lambda line: print(line), lambda line: print(line, file=sys.stderr))
