"""Benchmark: the harness against the naive procedure and against the floor, side by side in one run.

    .venv/bin/python benchmarks/bench_modes.py            # full run (about 15 minutes on 2 cores)
    .venv/bin/python benchmarks/bench_modes.py --quick    # CI smoke: small shapes, one run

On a mamba-130m-shaped checkpoint (seeded random weights, d_model 768, 24 layers,
d_state 16, expand 2, vocab 50280), all eight modes, layer-0 capture, seq 512:

  (a) harness  the real main job (pipeline.run): open, hash, tokenize, calibrate layer 0
               (cold cache), run every mode up to layer 0, compare, write .npz + stats;
  (b) naive    for each mode: open the model, calibrate every layer, run the whole
               model, capture layer 0 (the research tool's procedure);
  (c) floor    one calibration pass over layer 0 plus one bare layer-0 forward per mode.

Each measurement runs in its own process (peak memory = that process's max RSS,
torch included); the naive runs come first, then (a) and (c) alternate; medians
are reported. Also:
the scan against transformers' reference loop, the default 512 x 512 calibration
cold and cached, the shipped model's main job, and a mamba-1.4b-shaped fp16
checkpoint of which only layer 0 may be read. Results go to benchmarks/results.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import MODES, peak_mb, spawn  # noqa: E402




# ---------------------------------------------------------------- child procedures (one per process)

def _child_harness(a: dict) -> dict:
    from harness.runner.calibration import CalibrationSettings
    from harness.runner.pipeline import RunConfig, run

    cfg = RunConfig(model=Path(a["model"]), modes=a["modes"], output_file=Path(a["out"]) / "h.npz",
                    seq_len=a["seq_len"], calib=CalibrationSettings(a["calib_samples"], a["calib_seqlen"]),
                    cache_dir=Path(a["cache"]), layers=[0])
    start = time.perf_counter()
    outcome = run(cfg, emit=lambda _s: None)
    assert not outcome.failed, outcome.failed
    read = outcome.stats["provenance"]["model"]["tensors_read"]
    return {"seconds": time.perf_counter() - start, "calibration": outcome.stats["provenance"]["calibration"]["source"],
            "bytes_read": read["bytes"], "tensors_read": read["count"]}


def _prepare(a: dict):
    from harness.checkpoints.text import DEFAULT_CALIB_FILE, DEFAULT_TEXT_FILE, calibration_windows, read_sample
    from harness.checkpoints.tokenizer import load_tokenizer
    from harness.checkpoints.loading import open_checkpoint

    ckpt = open_checkpoint(a["model"])
    tok = load_tokenizer(a["model"])
    windows = calibration_windows(tok, DEFAULT_CALIB_FILE, a["calib_samples"], a["calib_seqlen"], 42).ids
    ids = read_sample(tok, DEFAULT_TEXT_FILE, a["seq_len"]).ids
    return ckpt, windows, ids


def _child_naive(a: dict) -> dict:
    from harness.runner.backbone import build_backbone
    from harness.recipes.quamba.calibration import run_observers
    from harness.emulation.capture import capture
    from harness.recipes.registry import get_mode
    from harness.runner.weightbank import WeightBank

    start = time.perf_counter()
    for mode in a["modes"]:
        ckpt, windows, ids = _prepare(a)                      # load the model (and the data) again
        bank = WeightBank(ckpt)
        last = ckpt.dims.n_layer - 1
        scales, _ = run_observers(bank, windows, last, 0.9995, 8)  # calibrate every layer
        model = build_backbone(get_mode(mode), bank, scales, last)
        with capture(model, ["L0.block.in", "L0.block.out", "L0.block.residual"]) as got:
            model(ids)                                         # run the whole model
        assert len(got) == 3
    return {"seconds": time.perf_counter() - start}


def _child_floor(a: dict) -> dict:
    from harness.runner.backbone import build_backbone
    from harness.recipes.quamba.calibration import run_observers
    from harness.recipes.registry import get_mode
    from harness.runner.weightbank import WeightBank

    ckpt, windows, ids = _prepare(a)
    ckpt.embedding()
    start = time.perf_counter()
    bank = WeightBank(ckpt)
    scales, _ = run_observers(bank, windows, 0, 0.9995, 8)
    for mode in a["modes"]:
        build_backbone(get_mode(mode), bank, scales, 0)(ids)
    return {"seconds": time.perf_counter() - start}


def _child_scan(a: dict) -> dict:
    """Median time of the harness scan (both orders) and transformers' reference loop at the same shape."""
    import torch

    from harness.kernels.scan import ScanOrder, selective_scan
    from harness.spec import FloatOut

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.models.mamba.modeling_mamba import mamba_selective_scan

    g = torch.Generator().manual_seed(0)
    b, l, e, n = 1, a["seq_len"], a["d_inner"], 16
    u, delta, z = (torch.randn(b, l, e, generator=g) for _ in range(3))
    A_log = torch.log(torch.arange(1, n + 1, dtype=torch.float32)).repeat(e, 1)
    B, C = torch.randn(b, l, n, generator=g), torch.randn(b, l, n, generator=g)
    D, bias = torch.ones(e), torch.zeros(e)
    calls = {
        "harness_reference": lambda: selective_scan(u, delta, A_log, B, C, D, z, delta_bias=bias, order=ScanOrder.REFERENCE, out=FloatOut(torch.float32)),
        "harness_kernel": lambda: selective_scan(u, delta, A_log, B, C, D, z, delta_bias=bias, order=ScanOrder.KERNEL, out=FloatOut(torch.float32)),
        "transformers": lambda: mamba_selective_scan(u.transpose(1, 2), delta.transpose(1, 2), -torch.exp(A_log),
                                                     B.transpose(1, 2), C.transpose(1, 2), D, z.transpose(1, 2), bias,
                                                     delta_softplus=True),
    }
    out = {}
    for name, fn in calls.items():
        fn()
        times = []
        for _ in range(5):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        out[f"{name}_ms"] = 1000 * statistics.median(times)
    return out


CHILDREN = {"harness": _child_harness, "naive": _child_naive, "floor": _child_floor, "scan": _child_scan}



# ---------------------------------------------------------------- the parent

def _side_by_side(model: Path, work: Path, args) -> dict:
    common = {"model": str(model), "modes": MODES, "seq_len": args.seq_len, "calib_samples": args.calib_samples,
              "calib_seqlen": args.calib_seqlen}
    runs: dict[str, list[dict]] = {"harness": [], "naive": [], "floor": []}
    # The naive runs go first: a process that just used several GB leaves the machine
    # slower for a while, and (a) and (c) should be measured under the same conditions,
    # so they alternate after it.
    for i in range(args.naive_runs):
        runs["naive"].append(spawn(__file__, "naive", common))
        print(f"  naive run {i + 1}/{args.naive_runs}: {runs['naive'][-1]['seconds']:.2f} s", flush=True)
    for i in range(args.runs):
        cache = work / f"cache-{i}"  # a cold calibration cache for every harness run
        runs["harness"].append(spawn(__file__, "harness", {**common, "out": str(work), "cache": str(cache)}))
        runs["floor"].append(spawn(__file__, "floor", common))
        print(f"  run {i + 1}/{args.runs}: harness {runs['harness'][-1]['seconds']:.2f} s, "
              f"floor {runs['floor'][-1]['seconds']:.2f} s", flush=True)
    med = {k: statistics.median(r["seconds"] for r in v) for k, v in runs.items()}
    peak = {k: max(r["peak_mb"] for r in v) for k, v in runs.items()}
    return {"runs": runs, "median_s": med, "peak_mb": peak}


def _default_calibration(model: Path, work: Path, args) -> dict:
    common = {"model": str(model), "modes": MODES, "seq_len": 512, "calib_samples": 512, "calib_seqlen": 512,
              "out": str(work), "cache": str(work / "cache-default")}
    cold = spawn(__file__, "harness", common)
    warm = spawn(__file__, "harness", common)
    return {"cold_s": cold["seconds"], "warm_s": warm["seconds"], "warm_source": warm["calibration"],
            "cold_peak_mb": cold["peak_mb"]}


def _big_checkpoint(work: Path, args) -> dict:
    import torch

    from checkpoints import write_random_checkpoint

    path = work / "mamba-1.4b-shaped"
    t = time.perf_counter()
    write_random_checkpoint(path, "mamba-1.4b", dtype=torch.float16)
    os.sync()
    size_mb = (path / "model.safetensors").stat().st_size / 2**20
    print(f"  wrote {size_mb:.0f} MiB in {time.perf_counter() - t:.0f} s", flush=True)
    try:
        r = spawn(__file__, "harness", {"model": str(path), "modes": ["fp32", "0"], "seq_len": 512, "calib_samples": 8,
                               "calib_seqlen": 512, "out": str(work), "cache": str(work / "cache-big")})
    finally:
        shutil.rmtree(path)
    return {"checkpoint_mb": size_mb, "peak_mb": r["peak_mb"], "seconds": r["seconds"],
            "read_mb": r["bytes_read"] / 2**20, "tensors_read": r["tensors_read"]}


def _table(res: dict) -> str:
    from tabulate import tabulate

    s = res["side_by_side"]
    rows = [["(a) harness", s["median_s"]["harness"], s["peak_mb"]["harness"], 1.0],
            ["(b) naive", s["median_s"]["naive"], s["peak_mb"]["naive"], s["median_s"]["naive"] / s["median_s"]["harness"]],
            ["(c) floor", s["median_s"]["floor"], s["peak_mb"]["floor"], s["median_s"]["floor"] / s["median_s"]["harness"]]]
    return tabulate(rows, headers=["procedure", "median s", "peak MB", "time / (a)"], floatfmt=".2f")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small shapes, one run (CI smoke)")
    p.add_argument("--runs", type=int, default=5, help="runs of (a) and (c) (default: 5)")
    p.add_argument("--naive-runs", type=int, default=3, help="runs of the slow naive procedure (default: 3)")
    p.add_argument("--calib-samples", type=int, default=8)
    p.add_argument("--calib-seqlen", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--skip-big", action="store_true", help="skip the mamba-1.4b-shaped lazy-loading check")
    p.add_argument("--skip-default-calib", action="store_true", help="skip the 512 x 512 calibration timing")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        out = CHILDREN[args.child[0]](json.loads(args.child[1]))
        print(json.dumps({**out, "peak_mb": peak_mb()}))
        return 0
    if args.quick:
        args.runs, args.naive_runs, args.calib_samples, args.calib_seqlen, args.seq_len = 1, 1, 2, 128, 128
        args.skip_big = args.skip_default_calib = True

    import torch

    from checkpoints import write_random_checkpoint

    res: dict = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                             "torch_threads": torch.get_num_threads()},
                 "calib_samples": args.calib_samples, "calib_seqlen": args.calib_seqlen, "seq_len": args.seq_len,
                 "runs": args.runs, "naive_runs": args.naive_runs, "modes": MODES, "quick": args.quick}
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        work = Path(tmp)
        shape = "mamba-130m"
        model = write_random_checkpoint(work / shape, shape)
        os.sync()  # no write-back of the fresh checkpoint during the measurements
        print(f"side by side on a {shape}-shaped checkpoint: seq {args.seq_len}, calibration "
              f"{args.calib_samples} x {args.calib_seqlen}, {len(MODES)} modes, {args.naive_runs} naive runs, "
              f"{args.runs} runs of (a) and (c)", flush=True)
        res["side_by_side"] = _side_by_side(model, work, args)
        med = res["side_by_side"]["median_s"]
        res["speedup_vs_naive"] = med["naive"] / med["harness"]
        res["ratio_to_floor"] = med["harness"] / med["floor"]
        res["peak_mb_harness"] = res["side_by_side"]["peak_mb"]["harness"]
        print("scan at seqlen", args.seq_len, flush=True)
        scan = spawn(__file__, "scan", {"seq_len": args.seq_len, "d_inner": 1536})
        res["scan"] = {**scan, "speedup_vs_transformers": scan["transformers_ms"] / scan["harness_reference_ms"]}
        if not args.skip_default_calib:
            print("default calibration 512 x 512, all modes, cold then cached", flush=True)
            res["default_calibration_130m"] = _default_calibration(model, work, args)
            tiny = {"model": str(ROOT / "models" / "mamba-tiny"), "modes": ["fp32", "0", "2-1", "2-2", "2-4"],
                    "seq_len": 512, "calib_samples": 512, "calib_seqlen": 512, "out": str(work),
                    "cache": str(work / "cache-tiny")}
            res["tiny_essential_cold_s"] = spawn(__file__, "harness", tiny)["seconds"]
        shutil.rmtree(model)
        if not args.skip_big:
            print("mamba-1.4b-shaped fp16 checkpoint, layer-0 capture", flush=True)
            res["big_1.4b"] = _big_checkpoint(work, args)
    print()
    print(_table(res))
    print(f"\nspeedup vs naive (b/a): {res['speedup_vs_naive']:.1f}x   ratio to floor (a/c): {res['ratio_to_floor']:.2f}"
          f"   peak MB of (a): {res['peak_mb_harness']:.0f}")
    print(f"scan at L={args.seq_len}: harness {res['scan']['harness_reference_ms']:.1f} ms (reference order), "
          f"{res['scan']['harness_kernel_ms']:.1f} ms (kernel order), transformers {res['scan']['transformers_ms']:.1f} ms "
          f"-> {res['scan']['speedup_vs_transformers']:.1f}x")
    if "default_calibration_130m" in res:
        d = res["default_calibration_130m"]
        print(f"130m, 8 modes, calibration 512 x 512: cold {d['cold_s']:.1f} s, cached {d['warm_s']:.1f} s; "
              f"shipped model, essential preset, cold: {res['tiny_essential_cold_s']:.1f} s")
    if "big_1.4b" in res:
        b = res["big_1.4b"]
        print(f"1.4b-shaped fp16 checkpoint of {b['checkpoint_mb']:.0f} MiB: layer-0 capture read {b['read_mb']:.0f} MiB "
              f"({b['tensors_read']} tensors), peak {b['peak_mb']:.0f} MB")
    out = Path(__file__).resolve().parent / "results.json"
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
