"""Write tests/data/golden_exact.json: a fingerprint of every captured array of every built-in mode.

The seeded 48-wide model of tests/architectures/mamba1/test_golden_exact.py, every built-in mode re-defined
with prep=exact, both layers, every tap. A fingerprint is the array's float64 L2 norm
and its dot products with four fixed +-1 vectors (numpy's PCG64, the same on every
machine): values that survive a change of CPU within a measured tolerance, where a
sha256 would not (the float modes' GEMMs and, before the portable ops, exp differ by
CPU). Run from the repository root:

    .venv/bin/python tests/data/make_golden_exact.py

History: the first version held sha256 digests from the code before `prep` existed
(commit 741a2d5, an AVX2 machine); it was regenerated with fingerprints when the
portable ops moved the numbers (docs/determinism.md says by how much).
"""
from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from conftest import make_hf_model, write_hf_dir  # noqa: E402
from helpers import run_modes  # noqa: E402

MODES = ["fp32", "1", "0", "2-0", "2-1", "2-2", "2-3", "2-4", "3"]
MODEL = dict(d_model=48, n_layer=2, d_state=16, seed=3)


N_PROJECTIONS = 4


def _signs(n: int) -> np.ndarray:
    """(N_PROJECTIONS, n) fixed +-1 vectors, from numpy's PCG64 (portable) seeded by n."""
    return np.random.default_rng(n).integers(0, 2, size=(N_PROJECTIONS, n)).astype(np.float64) * 2 - 1


def fingerprint(a: np.ndarray) -> dict:
    flat = a.astype(np.float64).reshape(-1)
    return {"dtype": str(a.dtype), "shape": list(a.shape), "l2": float(np.sqrt(flat @ flat)),
            "proj": [float(v) for v in _signs(flat.size) @ flat]}


def deviation(got: dict, golden: dict) -> float:
    """max |difference| of the L2 norm and the projections, relative to the golden L2 norm (0 for equal
    arrays; about the relative L2 error of a change; +inf when dtype or shape differ)."""
    if (got["dtype"], got["shape"]) != (golden["dtype"], golden["shape"]):
        return math.inf
    diffs = [abs(got["l2"] - golden["l2"])] + [abs(a - b) for a, b in zip(got["proj"], golden["proj"])]
    return max(diffs) / max(golden["l2"], 1e-30)


def digest(arrays: dict) -> dict[str, dict]:
    return {name: fingerprint(a) for name, a in sorted(arrays.items())}


def portable_model(seed: int = MODEL["seed"]):
    """The golden model with weights that are the same on every machine: torch's normal_ takes other code paths
    by CPU (its scalar and vector builds give other values), so every parameter is redrawn from numpy's PCG64
    as N(mean, std) with the mean and std of transformers' initialisation rounded to two digits."""
    import torch

    model = make_hf_model(**MODEL)
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            mean, std = (float(f"{float(v):.2g}") for v in (param.mean(), param.std() if param.numel() > 1 else 0))
            param.copy_(torch.from_numpy(rng.normal(mean, std, tuple(param.shape)).astype(np.float32)))
    return model


def capture(out: Path, modes_file: Path | None) -> dict[str, dict[str, str]]:
    model_dir = write_hf_dir(out / "m48", portable_model())
    names = [f"{m}x" for m in MODES] if modes_file else MODES
    outcome = run_modes(model_dir, out, names, taps=["all"], layers=[0, 1], seq_len=80, modes_file=modes_file,
                        cache=False)
    assert not outcome.failed, outcome.failed
    return {m: digest(outcome.by_mode[n]) for m, n in zip(MODES, names)}


def exact_modes_file(path: Path) -> Path:
    path.write_text(json.dumps({"modes": {f"{m}x": {"base": m, "prep": "exact"} for m in MODES}}))
    return path


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        result = capture(tmp, exact_modes_file(tmp / "exact.json"))
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "golden_exact.json"
    out.write_text(json.dumps({"model": MODEL, "modes": result}, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
