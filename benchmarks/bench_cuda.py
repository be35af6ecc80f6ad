"""--device cuda: the eight Mamba-1 modes, every layer, end to end, against transformers' own CUDA forward.

On seeded checkpoints of real shapes (benchmarks/checkpoints.py; no download): mamba-130m (24 layers) and
mamba-2.8b's width (d_model 2560) at --n-layer-28 of its 64 layers (default 8: the device time of a session is
15 minutes; the per-layer numbers scale linearly, both sides run the same layers). One sample of --seq-len tokens.

  hf         transformers' MambaForCausalLM fp32 forward on the GPU (the torch path it takes without mamba_ssm's
             CUDA extension), median of --runs after a warm-up; CUDA-synchronised
  calibrate  the harness's cold calibration of every layer (CPU, --calib windows), once
  run        `run(RunConfig(modes=all, layers=all, end_to_end=True, device="cuda"))`, calibration cached,
             stats only (no .npz): median of --runs
  ratio      run / (8 x hf): the target of issue 36's CPU table is 2x

Each shape runs in its own process (a failure or a timeout leaves the others' results). Writes
benchmarks/results_cuda.json (or --out). Needs a CUDA device; exits 2 without one.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import MODES, run_child, spawn  # noqa: E402


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _sync_timed(fn, runs: int, device: str) -> dict:
    times = []
    for _ in range(runs):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "runs": runs}


def _ids(model: Path, seq_len: int):
    import torch

    from harness.checkpoints.text import DEFAULT_TEXT_FILE, read_sample
    from harness.checkpoints.tokenizer import load_tokenizer

    tok = load_tokenizer(model)
    return torch.as_tensor(read_sample(tok, DEFAULT_TEXT_FILE, seq_len).ids).reshape(1, -1)


def _child_shape(a: dict) -> dict:
    import torch
    import transformers

    from checkpoints import write_random_checkpoint
    from harness import CalibrationSettings, RunConfig, run
    from harness.runtime.guard import Progress

    work = Path(a["work"])
    model = write_random_checkpoint(work / a["shape"], a["shape"], n_layer=a["n_layer"])
    dev = a["device"]
    ids = _ids(model, a["seq_len"]).to(dev)
    hf = transformers.MambaForCausalLM.from_pretrained(model, dtype=torch.float32).to(dev).eval()
    with torch.no_grad():
        hf(input_ids=ids[:, :16])
        hf_t = _sync_timed(lambda: hf(input_ids=ids).logits, a["runs"], dev)
    del hf
    if dev == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    cfg = RunConfig(model=model, modes=["all"], output_file=work / f"{a['shape']}.npz", seq_len=a["seq_len"],
                    layers=["all"], end_to_end=True, device=dev, stats_only=True, store_logits=False,
                    calib=CalibrationSettings(num_samples=a["calib"][0], seqlen=a["calib"][1]),
                    cache_dir=work / "cache")
    t0 = time.perf_counter()
    first = run(cfg, emit=lambda _l: None, progress=Progress())  # cold: calibrates every layer on the CPU
    cold = time.perf_counter() - t0
    assert not first.failed, first.failed
    run_t = _sync_timed(lambda: run(cfg, emit=lambda _l: None, progress=Progress()), a["runs"], dev)
    e2e = first.stats["end_to_end"]
    return {"shape": a["shape"], "n_layer": a["n_layer"], "seq_len": a["seq_len"], "hf": hf_t,
            "first_run_with_calibration_s": cold, "run": run_t,
            "ratio_to_8_hf": run_t["median_s"] / (len(MODES) * hf_t["median_s"]),
            "per_layer_run_s": run_t["median_s"] / a["n_layer"],
            "gpu_peak_mb": torch.cuda.max_memory_allocated() / 2**20 if dev == "cuda" else None,
            "kl_vs_fp32": {m: e2e[m].get("kl") for m in e2e}}


CHILDREN = {"shape": _child_shape}


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        run_child(sys.argv[2:], CHILDREN)
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["mamba-130m", "mamba-2.8b"])
    p.add_argument("--n-layer-28", type=int, default=8, help="layers of the 2.8b shape (of 64)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--calib", type=int, nargs=2, default=(16, 512), metavar=("WINDOWS", "SEQLEN"))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results_cuda.json")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a dry run of this script (both sides on the CPU)")
    a = p.parse_args()
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("bench_cuda: needs a CUDA device; torch sees none here", file=sys.stderr)
        return 2
    from checkpoints import SHAPES

    result = {"device": torch.cuda.get_device_name() if a.device == "cuda" else platform.processor() or "cpu", "torch": torch.__version__, "python": platform.python_version(),
              "modes": MODES, "shapes": {}}
    with tempfile.TemporaryDirectory() as work:
        for shape in a.shapes:
            n_layer = a.n_layer_28 if shape == "mamba-2.8b" else SHAPES[shape][1]
            args = {"shape": shape, "n_layer": n_layer, "seq_len": a.seq_len, "calib": list(a.calib),
                    "runs": a.runs, "work": work, "device": a.device}
            try:
                result["shapes"][shape] = spawn(__file__, "shape", args)
            except RuntimeError as exc:
                result["shapes"][shape] = {"error": str(exc)[-2000:]}
            a.out.write_text(json.dumps(result, indent=1))
            print(json.dumps({shape: result["shapes"][shape]}, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
