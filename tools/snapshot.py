"""Digest every number a set of runs produces, to prove a change moves none of them (same machine).

    .venv/bin/python tools/snapshot.py before.json              # run the set, write the digests
    .venv/bin/python tools/snapshot.py --compare before.json after.json

The set (small seeded models, a few minutes on 2 cores) covers what a refactoring could
move: every built-in mode (and mode 1) with every tap of two layers, isolated replay and two
samples; the whole-model path (every layer, end to end, sensitivity); and a Quamba W8A8
checkpoint (every layer, every tap, end to end). For each run it records the sha256 of every
array of the .npz and every value of the _stats.json, flattened to dotted paths, leaving out
what changes from run to run (timestamps, timings, temporary paths, the command line).
The comparison prints the first differences and exits 1 if there are any.
"""
from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

ALL_MODES = ["fp32", "1", "0", "2-0", "2-1", "2-2", "2-3", "2-4", "3"]
CALIB = ["--calib_data_num", "4", "--calib_seqlen", "32", "--no_cache"]
# stats keys whose values differ between two runs of the same command
VOLATILE = {"timestamp", "command", "pretrained_dir", "seconds", "timings", "elapsed", "platform", "torch_threads",
            "cpu", "path", "text_file", "wall_seconds", "shared_ops", "calibration_seconds", "duration"}
# values that hold the temporary directory's random name: the pretrained_dir array (the research
# tool's key) and the npz's sha256 over the file that holds it
IGNORED = {"pretrained_dir", "npz.sha256"}


def _runs(tmp: Path) -> dict[str, list[str]]:
    from conftest import make_hf_model, write_hf_dir
    from quamba_fixture import write_handmade

    model = write_hf_dir(tmp / "m48", make_hf_model(d_model=48, n_layer=3, d_state=16, seed=3))
    quamba = write_handmade(tmp / "q")
    return {
        "layers": ["--model", str(model), "--modes", *ALL_MODES, "--layers", "0", "1", "--taps", "all",
                   "--seq_len", "64", "--samples", "2", "--isolated", *CALIB],
        "whole": ["--model", str(model), "--modes", "fp32", "0", "2-4", "3", "--layers", "all", "--seq_len", "48",
                  "--samples", "2", "--end-to-end", "--sensitivity", *CALIB],
        "quamba": ["--model", str(quamba), "--modes", "0", "2-1", "2-4", "3", "--reference", "0", "--layers", "all",
                   "--taps", "all", "--seq_len", "48", "--end-to-end", *CALIB],
    }


def _flatten(obj, prefix: str, out: dict[str, str], tmp: str) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k not in VOLATILE:
                _flatten(v, f"{prefix}.{k}" if prefix else str(k), out, tmp)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _flatten(v, f"{prefix}[{i}]", out, tmp)
    else:
        out[prefix] = repr(obj).replace(tmp, "<tmp>")


def _digest(npz: Path, tmp: str) -> dict:
    with np.load(npz, allow_pickle=False) as f:
        arrays = {k: f"{hashlib.sha256(f[k].tobytes()).hexdigest()[:24]}|{f[k].dtype}|{list(f[k].shape)}"
                  for k in sorted(f.files) if k != "timestamp"}
    stats: dict[str, str] = {}
    _flatten(json.loads(npz.with_name(npz.stem + "_stats.json").read_text()), "", stats, tmp)
    return {"arrays": arrays, "stats": stats}


def snapshot() -> dict:
    from harness.cli import capture_main

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        result = {}
        for name, argv in _runs(tmp_path).items():
            out = tmp_path / f"{name}.npz"
            rc = capture_main([*argv, "--output_file", str(out), "--quiet"])
            result[name] = {"rc": rc, **_digest(out, tmp)}
        return result


def compare(a: dict, b: dict) -> list[str]:
    diffs = []
    for run in sorted(set(a) | set(b)):
        if run not in a or run not in b:
            diffs.append(f"{run}: only in one snapshot")
            continue
        if a[run]["rc"] != b[run]["rc"]:
            diffs.append(f"{run}: exit {a[run]['rc']} vs {b[run]['rc']}")
        for part in ("arrays", "stats"):
            x, y = a[run][part], b[run][part]
            for key in sorted((set(x) | set(y)) - IGNORED):
                if x.get(key) != y.get(key):
                    diffs.append(f"{run} {part} {key}: {x.get(key)} != {y.get(key)}")
    return diffs


def main(argv: list[str]) -> int:
    if argv[:1] == ["--compare"] and len(argv) == 3:
        a, b = (json.loads(Path(p).read_text()) for p in argv[1:])
        diffs = compare(a, b)
        counts = {run: (len(a[run]["arrays"]), len(a[run]["stats"])) for run in a}
        print(f"runs {', '.join(f'{r} ({n} arrays, {s} stats values)' for r, (n, s) in counts.items())}")
        print("\n".join(diffs[:40]) if diffs else "identical: every array and stats value")
        return 1 if diffs else 0
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    Path(argv[0]).write_text(json.dumps(snapshot(), indent=0, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
