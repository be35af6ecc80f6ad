"""Write tests/data/golden_exact.json: sha256 of every captured array of every built-in mode.

Generated once from the code before `prep` existed (commit 741a2d5), on the seeded
48-wide model of tests/test_golden_exact.py; that test checks that `prep=exact`
still reproduces each array bit for bit. Run from the repository root:

    .venv/bin/python tests/data/make_golden_exact.py

With a harness that has the `prep` knob it captures the built-in modes re-defined
with prep=exact (what the test checks), so a regenerated file is comparable.
"""
from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from conftest import make_hf_model, write_hf_dir  # noqa: E402
from helpers import run_modes  # noqa: E402

MODES = ["fp32", "1", "0", "2-0", "2-1", "2-2", "2-3", "2-4", "3"]
MODEL = dict(d_model=48, n_layer=2, d_state=16, seed=3)


def digest(arrays: dict) -> dict[str, str]:
    return {name: hashlib.sha256(a.tobytes()).hexdigest()[:32] + f"|{a.dtype}|{list(a.shape)}"
            for name, a in sorted(arrays.items())}


def capture(out: Path, modes_file: Path | None) -> dict[str, dict[str, str]]:
    model_dir = write_hf_dir(out / "m48", make_hf_model(**MODEL))
    names = [f"{m}x" for m in MODES] if modes_file else MODES
    outcome = run_modes(model_dir, out, names, taps=["all"], layers=[0, 1], seq_len=80, modes_file=modes_file,
                        cache=False)
    assert not outcome.failed, outcome.failed
    return {m: digest(outcome.by_mode[n]) for m, n in zip(MODES, names)}


def exact_modes_file(path: Path) -> Path:
    path.write_text(json.dumps({"modes": {f"{m}x": {"base": m, "prep": "exact"} for m in MODES}}))
    return path


def main() -> None:
    from harness.modes import KNOBS
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        modes_file = exact_modes_file(tmp / "exact.json") if "prep" in KNOBS else None
        result = capture(tmp, modes_file)
    (HERE / "golden_exact.json").write_text(json.dumps({"model": MODEL, "modes": result}, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
