"""Where `--device cuda` spends its time: one run of the eight Mamba-1 modes on a 130m-shaped seeded checkpoint.

    python benchmarks/profile_cuda.py [--n-layer 4] [--seq-len 512] [--out profile_cuda.json] [--device cpu]

After a cold calibration (CPU) and one warm-up run, one `run(modes=all, layers=all, end_to_end=True)` is timed three
ways on the same machine:
  wall         the run's wall time, CUDA-synchronised
  python       cProfile of a second run: cumulative seconds of the harness functions that take the most
  torch        torch.profiler of a third run: self CPU and self CUDA time by op, the number of kernels launched and
               the sum of the kernels' device time (GPU busy) against the wall time: a GPU busy a small fraction of
               the wall is waiting on the CPU (weight preparation, Python, launches)
Writes the JSON to --out and prints a summary. --device cpu: a dry run of this script without a GPU.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

TOP = 25


def _config(model: Path, work: Path, a: argparse.Namespace):
    from harness import CalibrationSettings, RunConfig

    return RunConfig(model=model, modes=["all"], output_file=work / "p.npz", seq_len=a.seq_len, layers=["all"],
                     end_to_end=True, device=a.device, stats_only=True, store_logits=False,
                     calib=CalibrationSettings(num_samples=8, seqlen=a.seq_len), cache_dir=work / "cache")


def _timed_run(cfg) -> float:
    import torch

    from harness import run
    from harness.runtime.guard import Progress

    if cfg.device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = run(cfg, emit=lambda _l: None, progress=Progress())
    if cfg.device == "cuda":
        torch.cuda.synchronize()
    assert not out.failed, out.failed
    return time.perf_counter() - t0


def _python_profile(cfg) -> list[dict]:
    prof = cProfile.Profile()
    prof.enable()
    _timed_run(cfg)
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (path, line, name), (_cc, calls, tottime, cumtime, _callers) in stats.stats.items():
        if "/harness/" in path:
            rows.append({"function": f"{path.split('/harness/')[-1]}:{line} {name}", "calls": calls,
                         "self_s": round(tottime, 3), "cumulative_s": round(cumtime, 3)})
    return sorted(rows, key=lambda r: -r["cumulative_s"])[:TOP * 2]


def _torch_profile(cfg) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cfg.device == "cuda" else [])
    with profile(activities=acts) as prof:
        wall = _timed_run(cfg)
    events = prof.key_averages()
    dev_key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"

    def rows(key: str) -> list[dict]:
        top = sorted(events, key=lambda e: -getattr(e, key, 0))[:TOP]
        return [{"op": e.key, "calls": e.count, "self_cpu_s": round(e.self_cpu_time_total / 1e6, 3),
                 "self_device_s": round(getattr(e, dev_key, 0) / 1e6, 3)} for e in top]
    kernels = [e for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e6
    return {"wall_s": round(wall, 2), "kernels": len(kernels), "gpu_busy_s": round(busy, 3),
            "gpu_busy_fraction": round(busy / wall, 4), "by_self_cpu": rows("self_cpu_time_total"),
            "by_self_device": rows(dev_key) if cfg.device == "cuda" else []}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-layer", type=int, default=4, help="layers of the 130m shape (of 24)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "profile_cuda.json")
    a = p.parse_args()
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("profile_cuda: needs a CUDA device; torch sees none here", file=sys.stderr)
        return 2
    from checkpoints import write_random_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = write_random_checkpoint(work / "m", "mamba-130m", n_layer=a.n_layer)
        cfg = _config(model, work, a)
        t0 = time.perf_counter()
        _timed_run(cfg)  # cold: calibrates on the CPU
        cold = time.perf_counter() - t0
        result = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "torch_version": torch.__version__,
                  "n_layer": a.n_layer, "seq_len": a.seq_len, "first_run_with_calibration_s": round(cold, 2),
                  "wall_s": round(_timed_run(cfg), 2), "python": _python_profile(cfg), "profiler": _torch_profile(cfg)}
    a.out.write_text(json.dumps(result, indent=1))
    t = result["profiler"]
    print(f"wall {result['wall_s']} s; under torch.profiler {t['wall_s']} s, {t['kernels']} kernels, "
          f"GPU busy {t['gpu_busy_s']} s ({100 * t['gpu_busy_fraction']:.1f} %)")
    for r in result["python"][:15]:
        print(f"  {r['cumulative_s']:8.2f} s cum {r['self_s']:7.2f} s self {r['calls']:7d}  {r['function']}")
    for r in t["by_self_cpu"][:10]:
        print(f"  cpu {r['self_cpu_s']:7.2f} s  dev {r['self_device_s']:7.2f} s {r['calls']:7d}  {r['op']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
