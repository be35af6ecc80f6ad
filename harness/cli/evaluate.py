"""`eval`: every mode on lm-evaluation-harness tasks (harness.lmeval.run), paired with the reference mode."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .guard import guarded
from .options import add_calibration_options, add_plugin_option, checked, opt, plugins_loaded, positive_int

__all__ = ["build_eval_parser", "eval_main"]

_limit = checked(float, lambda v: v > 0, "a positive number of examples per task (or a fraction below 1)")


def build_eval_parser(prog: str | None = None) -> argparse.ArgumentParser:
    from ..checkpoints.text import DATA_DIR

    p = argparse.ArgumentParser(prog=prog, description="Run every mode on lm-evaluation-harness tasks through the "
                                "quamba-harness model (one calibration), print a table per task and write "
                                "NAME_eval.json: each mode's metrics with stderr, the paired difference from the "
                                "reference mode over the same examples with its bootstrap interval, and the "
                                "per-example results (docs/eval.md).")
    default_model = DATA_DIR.parents[1] / "models" / "mamba-tiny"
    opt(p, "model", type=Path, default=default_model,
        help="float model directory, or a Quamba / Quamba2 checkpoint (default: the shipped models/mamba-tiny)")
    opt(p, "mamba_model_path", type=Path, default=None, help="the float model of a Quamba checkpoint --model")
    opt(p, "tokenizer", type=Path, default=None, help="directory with tokenizer.json (default: the model's)")
    opt(p, "modes", nargs="+", default=["fp32"], help="modes or presets (default: fp32)")
    opt(p, "modes_file", type=Path, default=None, help="JSON/TOML file of user modes")
    opt(p, "tasks", nargs="+", default=["quamba_lastword", "quamba_rolling"],
        help="lm-eval tasks (default: the local quamba_lastword quamba_rolling; lm-eval's own need their data)")
    opt(p, "include_path", type=Path, action="append", default=[], metavar="DIR",
        help="a directory of lm-eval task YAMLs (repeatable)")
    opt(p, "limit", type=_limit, default=None, help="examples per task (default: all)")
    opt(p, "output", type=Path, default=Path("lmeval"), metavar="NAME", help="writes NAME_eval.json (default: lmeval)")
    opt(p, "reference", default="fp32", help="the mode the others are paired with (default: fp32)")
    opt(p, "batch_size", type=positive_int, default=8, help="sequences per forward (default: 8)")
    opt(p, "max_length", type=positive_int, default=2048, help="the model's context for lm-eval (default: 2048)")
    opt(p, "bootstrap_iters", type=positive_int, default=1000, help="paired bootstrap resamples (default: 1000)")
    opt(p, "workers", type=positive_int, default=1, help="local processes running the units (default: 1)")
    opt(p, "ray", default=None, metavar="ADDRESS",
        help="run the units as tasks of the Ray cluster at ADDRESS (host:port, auto, or local: one started for "
             "this run; the cluster extra)")
    g = p.add_argument_group("calibration (as for capture; the calibration cache is shared)")
    add_calibration_options(g)
    opt(p, "quiet", action="store_true", help="print only errors and the tables")
    add_plugin_option(p)
    return p


def eval_main(argv: list[str] | None = None, prog: str | None = None) -> int:
    return guarded(_eval, argv, prog)


def _eval(argv: list[str] | None, prog: str | None, progress) -> int:
    args = build_eval_parser(prog).parse_args(argv)
    if not plugins_loaded(args.plugin):
        return 2
    try:
        import lm_eval  # noqa: F401  (the eval extra)
    except ImportError:
        print("error: eval needs lm-evaluation-harness: pip install 'quamba-harness[eval]' (lm_eval==0.4.13)",
              file=sys.stderr)
        return 2
    from ..lmeval.results import eval_path
    from ..lmeval.run import EvalConfig, EvalInputError, run_eval
    from ..runtime.guard import Interrupted
    from ..runner.calibration import CalibrationSettings, default_cache_dir
    from ..runner.pipeline import InputError

    cfg = EvalConfig(model=args.model, modes=args.modes, tasks=args.tasks, output=args.output,
                     mamba_model_path=args.mamba_model_path, tokenizer=args.tokenizer, reference=args.reference,
                     include_path=args.include_path, limit=args.limit,
                     calib=CalibrationSettings(args.calib_data_num, args.calib_seqlen, args.percentile_alpha,
                                               args.calib_batch_size, args.seed),
                     calib_file=args.calib_file, cache_dir=None if args.no_cache else (args.cache_dir or default_cache_dir()),
                     plugins=args.plugin, modes_file=args.modes_file, batch_size=args.batch_size,
                     max_length=args.max_length, bootstrap_iters=args.bootstrap_iters, workers=args.workers,
                     ray=args.ray,
                     argv=list(sys.argv))
    progress.phase = "evaluating"
    out = eval_path(cfg.output)
    before = out.stat().st_mtime_ns if out.exists() else None
    try:
        doc = run_eval(cfg, emit=print, progress=progress.silenced(args.quiet))
    except (EvalInputError, *InputError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:  # the file is rewritten whole after every unit: it holds what finished
        now = out.stat().st_mtime_ns if out.exists() else None
        kept = "nothing was written" if now is None else f"{out} is unchanged" if now == before else \
            f"{out} holds every mode and task that finished (status ok; a mode cut short: running or pending)"
        print(f"interrupted by {e.name} while evaluating: {kept}", file=sys.stderr)
        return e.exit_code
    failed = [m for m, e in doc["modes"].items() if e.get("status") != "ok"]
    if failed:
        print(f"failed modes: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
