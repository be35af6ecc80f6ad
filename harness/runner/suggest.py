"""`python -m harness formats --suggest BUDGET`: the cheapest per-layer format assignment whose end-to-end KL
stays within BUDGET, proposed from a sensitivity study and verified by one run of the proposal.

1. One user mode per candidate format (weights and activations in it, on the fp32 recipe), run with
   --sensitivity: the KL of each block alone in that format, the rest in fp32 (runner.studies).
2. ``choose``: every block starts in its lowest-KL format; then, while the summed per-block KL stays within
   the budget, the move (one block to a cheaper format) with the smallest KL increase per bit saved is taken.
3. The proposal is written as a modes file (``layers`` table) and run once end to end; its measured KL is
   reported beside the budget (per-block KLs do not add exactly: the verification is the answer).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from ..emulation.ops.formats import FORMATS
from ..modes import ModeError
from ..store.format import StorageError, check_output, write_json
from .config import RunConfig
from .pipeline import InputError, run

__all__ = ["DEFAULT_LADDER", "choose", "suggest", "suggest_main"]

DEFAULT_LADDER = ("bf16", "mxfp8_e4m3", "mxfp6_e2m3", "mxfp4_e2m1")
SUGGESTED = "suggested"


def _mode_name(fmt: str) -> str:
    return "fmt-" + fmt.replace("_", "-")


def _knobs(fmt: str) -> dict[str, str]:
    return {"weight_format": fmt, "act_format": fmt}


def choose(kl: dict[str, dict[int, float]], budget: float) -> dict[int, str]:
    """format -> block -> KL of that block alone in it  =>  block -> format (see the module docstring)."""
    layers = sorted(next(iter(kl.values())))
    pick = {i: min(kl, key=lambda f: (kl[f][i], -FORMATS[f].bits)) for i in layers}
    total = sum(kl[pick[i]][i] for i in layers)
    while True:
        moves = [((kl[f][i] - kl[pick[i]][i]) / (FORMATS[pick[i]].bits - FORMATS[f].bits), i, f)
                 for i in layers for f in kl if FORMATS[f].bits < FORMATS[pick[i]].bits
                 and total + kl[f][i] - kl[pick[i]][i] <= budget]
        if not moves:
            return pick
        _, i, f = min(moves)
        total += kl[f][i] - kl[pick[i]][i]
        pick[i] = f


def _modes_file(path: Path, modes: dict) -> Path:
    path.write_text(json.dumps({"modes": modes}))
    return path


def suggest(model: Path | None, formats: list[str], budget: float, *, seq_len: int = 512, emit=lambda _s: None) -> dict:
    """The study, the proposal and its verification: {"budget", "bits", "kl_by_format", "assignment",
    "modes", "verified_kl", "within_budget"}; "modes" is the modes file's content."""
    base = {} if model is None else {"model": model}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        study = {_mode_name(f): {"base": "fp32", "title": f"weights and activations {f}", **_knobs(f)} for f in formats}
        emit(f"sensitivity of {len(formats)} formats, every block alone in each ...")
        out = run(RunConfig(**base, modes=["fp32", *study], modes_file=_modes_file(work / "study.json", study),
                            output_file=work / "study.npz", seq_len=seq_len, layers=["all"], sensitivity=True,
                            stats_only=True), emit=lambda _s: None)
        kl = {f: {int(i): row["kl"] for i, row in out.stats["sensitivity"][_mode_name(f)].items()} for f in formats}
        pick = choose(kl, budget)
        layers = {str(i): _knobs(f) for i, f in pick.items()}
        modes = {SUGGESTED: {"base": "fp32", "title": f"suggested per-layer formats, KL budget {budget}",
                             "layers": layers}}
        emit("verifying the proposal with one run ...")
        check = run(RunConfig(**base, modes=["fp32", SUGGESTED], modes_file=_modes_file(work / "s.json", modes),
                              output_file=work / "verify.npz", seq_len=seq_len, layers=[0], end_to_end=True,
                              stats_only=True), emit=lambda _s: None)
    verified = check.stats["end_to_end"][SUGGESTED]["kl"]
    verified = verified["mean"] if isinstance(verified, dict) else verified
    bits = sum(FORMATS[f].bits for f in pick.values()) / len(pick)
    return {"budget": budget, "bits": bits, "kl_by_format": {f: {str(i): v for i, v in d.items()} for f, d in kl.items()},
            "assignment": {str(i): f for i, f in pick.items()}, "modes": {"modes": modes},
            "verified_kl": verified, "within_budget": verified <= budget}


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Propose the cheapest per-layer formats whose end-to-end KL "
                                "stays within BUDGET (a sensitivity study per format, then one verifying run).")
    p.add_argument("--suggest", type=float, required=True, metavar="BUDGET", help="end-to-end KL budget (nats)")
    p.add_argument("--model", type=Path, default=None, help="float model directory (default: the shipped one)")
    p.add_argument("--formats", nargs="+", default=list(DEFAULT_LADDER), help="candidate formats")
    p.add_argument("--seq_len", "--seq-len", dest="seq_len", type=int, default=512, help="tokens (default 512)")
    p.add_argument("--output", type=Path, default=Path("suggested_modes.json"), help="the modes file to write")
    return p


def suggest_main(argv: list[str], prog: str = "python -m harness formats") -> int:
    args = _parser(prog).parse_args(argv)
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


def formats_command(argv: list[str]) -> int:
    """The --suggest form of `python -m harness formats`, with SIGINT/SIGTERM a clean exit."""
    from ..runtime.guard import Interrupted, handle_signals

    try:
        with handle_signals():
            return suggest_main(argv)
    except Interrupted as e:
        print(f"interrupted by {e.name}; nothing was written", file=sys.stderr)
        return e.exit_code
