"""Benchmark: the sensitivity study of all eight modes, serial against --workers N (issue 25).

    .venv/bin/python benchmarks/bench_workers.py                       # small shape (d_model 256, 6 layers)
    .venv/bin/python benchmarks/bench_workers.py --shape mamba-130m    # the issue's shape (192 units; slow)

Each run is the command line in its own process with OMP_NUM_THREADS=1 (one torch thread: the serial
run and every worker), on a seeded random checkpoint of the shape (vocab 50280), all eight modes,
``--layers all --sensitivity``, the calibration cache warmed first (so the driver's calibration, the
same in both, is a cache read). Reported per run: wall seconds; for --workers: the units, the seconds
the units computed (summed over workers), the wall time from the first unit submitted to the last
finished, and from these the per-unit overhead = (slots x unit wall - unit seconds) / units (start-up of
the workers, shipping, merging in the driver, idle slots at the ends) and the driver's serial part =
wall - unit wall. The two pairs are checked bit-identical (tools/snapshot.py's digests).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tools"))

from checkpoints import SHAPES, write_random_checkpoint  # noqa: E402
from common import MODES  # noqa: E402

SHAPES.setdefault("small", (256, 6))  # a smaller-than-130m shape for a loaded 2-core machine


def _run(model: Path, out: Path, cache: Path, seq_len: int, extra: list[str], study: bool = True
         ) -> tuple[float, dict]:
    argv = [sys.executable, "-m", "harness", "capture", "--model", str(model), "--modes", *MODES, "--layers", "all",
            *(["--sensitivity"] if study else []), "--seq_len", str(seq_len), "--calib_data_num", "8", "--calib_seqlen", str(seq_len),
            "--cache_dir", str(cache), "--output_file", str(out), "--quiet", *extra]
    out.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"capture failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return wall, json.loads(out.with_name(out.stem + "_stats.json").read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="small", choices=sorted(SHAPES))
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    from snapshot import _digest

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = write_random_checkpoint(tmp / args.shape, args.shape)
        cache = tmp / "cache"
        _run(model, tmp / "warm" / "run.npz", cache, args.seq_len, [], study=False)  # fills the calibration cache
        serial_wall, serial = _run(model, tmp / "serial" / "run.npz", cache, args.seq_len, [])
        par_wall, par = _run(model, tmp / "par" / "run.npz", cache, args.seq_len, ["--workers", str(args.workers)])
        a, b = (_digest(tmp / d / "run.npz", str(tmp / d)) for d in ("serial", "par"))
        same_arrays = a["arrays"] == b["arrays"]
        same_stats = [k for k in a["stats"] if not k.startswith("provenance.workers") and k != "npz.sha256"
                      and a["stats"][k] != b["stats"].get(k)] == []
    w = par["provenance"]["workers"]
    overhead = (w["slots"] * w["wall_seconds"] - w["unit_seconds"]) / w["units"]
    result = {"shape": args.shape, "dims": SHAPES[args.shape], "seq_len": args.seq_len, "modes": len(MODES),
              "cpu_count": os.cpu_count(), "load_average": os.getloadavg(),
              "serial_seconds": round(serial_wall, 2), "workers": args.workers,
              "workers_seconds": round(par_wall, 2), "speedup": round(serial_wall / par_wall, 3),
              "units": w["units"], "unit_seconds": w["unit_seconds"], "unit_wall_seconds": w["wall_seconds"],
              "mean_unit_seconds": round(w["unit_seconds"] / w["units"], 4),
              "overhead_per_unit_seconds": round(overhead, 4),
              "driver_serial_seconds": round(par_wall - w["wall_seconds"], 2),
              "serial_mode_loop_seconds": round(sum(m.get("seconds") or 0 for m in serial["modes"].values()), 2),
              "bit_identical": same_arrays and same_stats}
    print(json.dumps(result, indent=2))
    return 0 if result["bit_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
