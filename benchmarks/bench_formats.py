"""harness.formats' fake_quantize per format against torchao's own call (issue 24's performance targets).

  per format   fake_quantize(x, fmt) on a seeded 512 x 1536 float32 tensor: median wall and CPU time
               over --runs calls (after one warm-up call)
  torchao      for MX and NVFP4 the call the definitions follow, MXTensor.to_mx(x, elem, 32).dequantize(fp32)
               and NVFP4Tensor.to_nvfp4(x, 16, per_tensor_scale).dequantize(fp32), eager CPU
  int8         the harness's int8 activation quantizer (ops.quant.quantize at the tensor's absmax scale),
               the baseline the issue names
  sweep        `python -m harness formats FILE` over all formats in-process (--sweep FILE, e.g. the make-run
               file first_layer_io_all_modes.npz from ./capture_first_layer.sh essential)

The machine is shared: CPU time is the steadier number. Writes benchmarks/results_formats.json.
    python benchmarks/bench_formats.py [--runs 5] [--rows 512] [--sweep first_layer_io_all_modes.npz]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from harness.kernels.quant import quantize  # noqa: E402
from harness.formats import FORMATS, fake_quantize  # noqa: E402
from harness.spec import Rounding  # noqa: E402

MX_ELEM = {"mxfp8_e4m3": torch.float8_e4m3fn, "mxfp8_e5m2": torch.float8_e5m2, "mxfp6_e2m3": "fp6_e2m3",
           "mxfp6_e3m2": "fp6_e3m2", "mxfp4_e2m1": torch.float4_e2m1fn_x2}


def _time(fn, runs: int) -> dict:
    fn()
    walls, cpus = [], []
    for _ in range(runs):
        w, c = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w)
        cpus.append(time.process_time() - c)
    return {"wall_ms": round(1e3 * statistics.median(walls), 2), "cpu_ms": round(1e3 * statistics.median(cpus), 2)}


def _torchao_calls(x: torch.Tensor) -> dict:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.prototype.mx_formats.mx_tensor import MXTensor
            from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
    except ImportError:
        return {}
    calls = {f: (lambda e=e: MXTensor.to_mx(x, e, block_size=32).dequantize(torch.float32)) for f, e in MX_ELEM.items()}
    calls["nvfp4"] = lambda: NVFP4Tensor.to_nvfp4(x, block_size=16, per_tensor_scale=per_tensor_amax_to_scale(
        x.abs().amax())).dequantize(torch.float32)
    calls["nvfp4_noglobal"] = lambda: NVFP4Tensor.to_nvfp4(x, block_size=16).dequantize(torch.float32)
    return calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--cols", type=int, default=1536)
    ap.add_argument("--sweep", type=Path, default=None, help="a capture file to sweep over all formats")
    args = ap.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(args.rows, args.cols, generator=torch.Generator().manual_seed(0))
    ours = {f: _time(lambda f=f: fake_quantize(x, f), args.runs) for f in FORMATS}
    theirs = {f: _time(call, args.runs) for f, call in _torchao_calls(x).items()}
    scale = float(x.abs().amax() / 127)
    int8 = _time(lambda: quantize(x, scale, Rounding.HALF_EVEN).dequantize(), args.runs)
    rows = []
    for f, t in ours.items():
        ref = theirs.get(f)
        rows.append({"format": f, **t, "torchao_cpu_ms": ref["cpu_ms"] if ref else None,
                     "vs_torchao": round(t["cpu_ms"] / ref["cpu_ms"], 2) if ref else None,
                     "vs_int8": round(t["cpu_ms"] / int8["cpu_ms"], 2)})
    result = {"shape": [args.rows, args.cols], "threads": 1, "int8_quantizer": int8, "formats": rows}
    if args.sweep is not None:
        from harness.report.formats import sweep_file
        result["sweep"] = {"file": str(args.sweep), **_time(lambda: sweep_file(args.sweep), 1)}
    print(f"{'format':<16}{'cpu ms':>9}{'torchao':>9}{'ratio':>7}{'vs int8':>9}")
    for r in rows:
        print(f"{r['format']:<16}{r['cpu_ms']:>9}{r['torchao_cpu_ms'] or '-':>9}{r['vs_torchao'] or '-':>7}{r['vs_int8']:>9}")
    print(f"int8 quantizer: {int8['cpu_ms']} ms cpu")
    if "sweep" in result:
        print(f"sweep of {args.sweep}: {result['sweep']['wall_ms'] / 1e3:.2f} s wall, {result['sweep']['cpu_ms'] / 1e3:.2f} s cpu")
    out = ROOT / "benchmarks" / "results_formats.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
