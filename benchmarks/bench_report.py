"""Benchmark of the HTML report (targets: under 10 s for the `make run` file, under 60 s for a
mamba-130m-shaped, 24-layer, 8-mode, --taps all file; the `make run` report under 10 MB).

    .venv/bin/python benchmarks/bench_report.py              # both files
    .venv/bin/python benchmarks/bench_report.py --quick      # smaller big file (CI smoke)

(a) make run   the real main job (essential modes, layer 0, shipped model, calibration cached),
               then the report of its file (the time of write_report, median of --repeat runs).
(b) 130m file  a synthetic capture with the layout and shapes the harness writes for a
               130m checkpoint (d_model 768, d_inner 1536, d_state 16, dt_rank 48), 24 layers x
               every capture point x 8 modes, with stats (scales, saturation, comparison) as the
               pipeline writes them; seq --seq tokens (default 64: 24 x 15 points x 8 modes at 512
               tokens would be a 7 GB file). The report uses its default tensor selection.
(c) many modes (--many N, default 2000): a research-layout file of N modes x (input, output,
               residual) of [1, 8, 16] (every 7th mode equal to fp32): the CPU time of report and of
               compare, which must grow about linearly with N (issue 21 15d: 2000 modes took over
               10 minutes). `--many 200` and `--many 2000` side by side show the slope.
Results go to benchmarks/report_results.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODES = ["fp32", "0", "2-0", "2-1", "2-2", "2-3", "2-4", "3"]
DIMS = {"d_model": 768, "d_inner": 1536, "d_state": 16, "dt_rank": 48}
INT8_POINTS = ("norm.out", "in_proj.out", "conv1d.in", "x_proj.in", "x_proj.out", "dt_proj.out", "ssm.u", "had.out")


def _width(point: str) -> int:
    d = DIMS
    return {"in_proj.out": 2 * d["d_inner"], "x_proj.out": d["dt_rank"] + 2 * d["d_state"]}.get(
        point, d["d_model"] if point in ("block.in", "norm.out", "out_proj.out", "block.out", "block.residual") else d["d_inner"])


def write_130m_file(path: Path, seq: int, layers: int = 24) -> None:
    from harness.emulation.capture import POINTS
    from harness.metrics.compare import compare_modes
    from harness.metrics.errors import tensor_stats
    from harness.store.format import SCHEMA_VERSION, array_key, stats_path, tensor_name, write_json, write_npz

    rng = np.random.default_rng(0)
    arrays, modes = {}, {}
    for m_i, mode in enumerate(MODES):
        modes[mode] = {"status": "ok", "title": mode, "recipe": {"weights": "fp32" if mode == "fp32" else "int8"},
                       "tensors": {}}
    by_mode: dict[str, dict[str, np.ndarray]] = {m: {} for m in MODES}
    for layer in range(layers):
        for point in POINTS:
            name = tensor_name(f"L{layer}.{point}")
            shape = (1, DIMS["d_inner"], DIMS["d_state"]) if point == "ssm.state" else (1, seq, _width(point))
            ref = rng.standard_normal(shape, dtype=np.float32)
            for m_i, mode in enumerate(MODES):
                quant = mode != "fp32" and point in INT8_POINTS
                scale = float(np.abs(ref).max() / 127.5) if quant else None
                val = ref if mode == "fp32" else ref + np.float32(0.002 * m_i * (1 + layer / 8)) * rng.standard_normal(
                    shape, dtype=np.float32)
                codes = None
                if quant:
                    codes = np.clip(np.rint(val / scale), -128, 127).astype(np.int8)
                    val = (codes.astype(np.float32) * np.float32(scale))
                by_mode[mode][name] = val
                arrays[array_key(mode, name)] = val
                modes[mode]["tensors"][name] = {"point": f"L{layer}.{point}", **tensor_stats(val, codes, scale, 0)}
    comparison = compare_modes({m: list(a) for m, a in by_mode.items()}, lambda m, t: by_mode[m][t], "fp32")
    write_npz(path, arrays)
    write_json(stats_path(path), {"schema_version": SCHEMA_VERSION, "model": "mamba-130m-shaped", "seq_len": seq,
                                  "stats_only": False, "provenance": {"layers": list(range(layers)), "taps": ["all"]},
                                  "modes": modes, "aliases": {}, "comparison": comparison, "failed_modes": []})


def _time_report(npz: Path, repeat: int) -> dict:
    from harness.report.build import write_report

    times, cpu = [], []
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        out = write_report(npz)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    # wall time and this process's CPU time (on a shared machine the wall time includes waiting for a core)
    return {"seconds": round(statistics.median(times), 2), "cpu_seconds": round(statistics.median(cpu), 2),
            "runs": [round(t, 2) for t in times], "bytes": out.stat().st_size, "images": out.read_text().count("<img")}


def write_many_modes_file(path: Path, n_modes: int) -> None:
    from harness.store.format import write_npz

    rng = np.random.default_rng(0)
    ref = {t: rng.standard_normal((1, 8, 16), dtype=np.float32) for t in ("input", "output", "residual")}
    arrays = {}
    for i in range(n_modes):
        mode = "fp32" if i == 0 else f"m{i}"
        for t, r in ref.items():
            same = i == 0 or t == "input" or i % 7 == 1
            arrays[f"mode_{mode}_{t}"] = r if same else r + np.float32(1e-3 * i)
    write_npz(path, arrays)


def _time_many_modes(npz: Path, n_modes: int) -> dict:
    from contextlib import redirect_stdout
    import io

    from harness.cli import compare_main
    from harness.report.build import write_report

    write_many_modes_file(npz, n_modes)
    start = time.process_time()
    write_report(npz)
    report_cpu = time.process_time() - start
    start = time.process_time()
    with redirect_stdout(io.StringIO()):
        compare_main([str(npz)])
    return {"modes": n_modes, "report_cpu_seconds": round(report_cpu, 2),
            "compare_cpu_seconds": round(time.process_time() - start, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="4 layers instead of 24 for the big file")
    p.add_argument("--seq", type=int, default=64, help="tokens of the 130m-shaped file (default 64)")
    p.add_argument("--repeat", type=int, default=3, help="report runs per file (median)")
    p.add_argument("--skip", choices=("make-run", "130m"), default=None, help="leave one measurement out")
    p.add_argument("--many", type=int, default=0, metavar="N",
                   help="also time report and compare of an N-mode research-layout file (e.g. 2000)")
    p.add_argument("--keep", type=Path, default=None, help="write the 130m-shaped file here and keep it")
    args = p.parse_args(argv)
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.skip != "make-run":
            from harness.runner.pipeline import RunConfig, run

            from harness.runner.calibration import default_cache_dir
            run(RunConfig(modes=["essential"], output_file=work / "first_layer_io_all_modes.npz",
                          cache_dir=default_cache_dir()), emit=lambda _s: None)
            results["make_run"] = _time_report(work / "first_layer_io_all_modes.npz", args.repeat)
            print(f"make run file: {results['make_run']}")
        if args.skip != "130m":
            layers = 4 if args.quick else 24
            start = time.perf_counter()
            big = args.keep or work / "big.npz"
            if not big.exists():
                write_130m_file(big, args.seq, layers)
            made = time.perf_counter() - start
            results["130m"] = {"layers": layers, "modes": len(MODES), "seq": args.seq,
                               "npz_bytes": big.stat().st_size, "setup_seconds": round(made, 1),
                               **_time_report(big, 1 if args.repeat < 2 else 2)}
            print(f"130m-shaped file: {results['130m']}")
        if args.many:
            results["many_modes"] = _time_many_modes(work / "many.npz", args.many)
            print(f"{args.many}-mode research file: {results['many_modes']}")
    out = Path(__file__).resolve().parent / "report_results.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
