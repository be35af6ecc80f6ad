"""Cost of the atomic .npz + _stats.json pair: write_pair (temporary file, fsync, sha256, two renames) and
load_capture (sha256 check) on the arrays of the main job on a 130m-shaped model (8 modes x 3 tensors of
512 x 768 float32), against the plain temporary-file-and-rename write. Prints one line per run.

    python benchmarks/bench_write.py [--runs N]
"""
import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from harness.store.format import write_json, write_npz, write_pair
from harness.store.reader import load_capture


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    arrays = {f"mode_{m}_{t}": rng.standard_normal((1, 512, 768)).astype(np.float32)
              for m in "abcdefgh" for t in ("input", "output", "residual")}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        for _ in range(args.runs):
            t = time.perf_counter()
            write_npz(d / "plain.npz", arrays)
            write_json(d / "plain_stats.json", {"schema_version": 1})
            plain = time.perf_counter() - t
            t = time.perf_counter()
            write_pair(d / "pair.npz", arrays, {"schema_version": 2})
            pair = time.perf_counter() - t
            t = time.perf_counter()
            load_capture(d / "pair.npz")
            read = time.perf_counter() - t
            print(f"{os.path.getsize(d / 'pair.npz') / 1e6:.1f} MB: plain write {plain:.3f} s, "
                  f"write_pair {pair:.3f} s, load_capture {read:.3f} s")


if __name__ == "__main__":
    main()
