"""`python -m harness formats --suggest BUDGET`: the cheapest per-layer format assignment whose end-to-end KL
stays within BUDGET, proposed from a sensitivity study and verified by one run of the proposal.

1. One user mode per candidate format (weights and activations in it, on the fp32 recipe), run with
   --sensitivity: the KL of each block alone in that format, the rest in fp32 (runner.studies).
2. ``choose``: every block starts in its lowest-KL format; then, while the summed per-block KL stays within
   the budget, the move (one block to a cheaper format) with the smallest KL increase per bit saved is taken.
3. The proposal is written as a modes file (``layers`` table) and run once end to end; its measured KL is
   reported beside the budget (per-block KLs do not add exactly: the verification is the answer).

Where the modes file may go (``check_suggestion_output``, before any work): a path whose directory exists
and that is nothing yet, or a previous suggestion (``is_suggestion``: a JSON object holding only the mode
``suggested``), which is replaced. Any other existing file (the model's config.json or weights, the text,
a modes file of your own), a directory or a special file is refused: nothing a user has is overwritten.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from ..kernels.formats import FORMATS
from ..store.files import StorageError, check_writable, read_regular, same_file
from ..runtime.guard import Progress
from .config import DEFAULT_MODEL, RunConfig
from .pipeline import run

__all__ = ["DEFAULT_LADDER", "SUGGESTED", "choose", "suggest", "is_suggestion", "check_suggestion_output"]

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


def is_suggestion(path: Path) -> bool:
    """Whether `path` holds a modes file this command wrote: {"modes": {"suggested": {..., "layers": ...}}}."""
    try:
        data = json.loads(read_regular(path, 1 << 20))
    except (OSError, StorageError, UnicodeDecodeError, ValueError, RecursionError):
        return False
    modes = data.get("modes") if isinstance(data, dict) else None
    return (isinstance(modes, dict) and set(data) == {"modes"} and set(modes) == {SUGGESTED}
            and isinstance(modes[SUGGESTED], dict) and "layers" in modes[SUGGESTED])


def _what_it_is(path: Path, model: Path) -> str:
    defaults = RunConfig()
    if os.path.realpath(path.parent) == os.path.realpath(model):
        return f"a file of the model directory {model}"
    for what, other in (("the text file", defaults.text_file), ("the calibration file", defaults.calib_file)):
        if same_file(path, other):
            return f"{what} of the run ({other})"
    return "a file this command did not write"


def check_suggestion_output(path: Path, model: Path | None = None) -> None:
    """Refuse (StorageError) an --output the command may not write, before any work (see the module docstring)."""
    path, model = Path(path), Path(model or DEFAULT_MODEL)
    check_writable(path)  # its directory exists and is writable; not a directory or special file
    if os.path.lexists(path) and not is_suggestion(path):
        raise StorageError(f"cannot write --output {path}: it is {_what_it_is(path, model)} and not a previous "
                           f"suggestion, so it is left alone; choose a new file name, e.g. suggested_modes.json")


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
                            stats_only=True), emit=lambda _s: None, progress=Progress())
        kl = {f: {int(i): row["kl"] for i, row in out.stats["sensitivity"][_mode_name(f)].items()} for f in formats}
        pick = choose(kl, budget)
        layers = {str(i): _knobs(f) for i, f in pick.items()}
        modes = {SUGGESTED: {"base": "fp32", "title": f"suggested per-layer formats, KL budget {budget}",
                             "layers": layers}}
        emit("verifying the proposal with one run ...")
        check = run(RunConfig(**base, modes=["fp32", SUGGESTED], modes_file=_modes_file(work / "s.json", modes),
                              output_file=work / "verify.npz", seq_len=seq_len, layers=[0], end_to_end=True,
                              stats_only=True), emit=lambda _s: None, progress=Progress())
    verified = check.stats["end_to_end"][SUGGESTED]["kl"]
    verified = verified["mean"] if isinstance(verified, dict) else verified
    bits = sum(FORMATS[f].bits for f in pick.values()) / len(pick)
    return {"budget": budget, "bits": bits, "kl_by_format": {f: {str(i): v for i, v in d.items()} for f, d in kl.items()},
            "assignment": {str(i): f for i, f in pick.items()}, "modes": {"modes": modes},
            "verified_kl": verified, "within_budget": verified <= budget}
