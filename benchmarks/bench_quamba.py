"""Benchmark: all eight modes from a mamba-130m-shaped Quamba W8A8 checkpoint against eight bare layer-0 forwards.

    .venv/bin/python benchmarks/bench_quamba.py            # 5 alternating runs of each (a few minutes)
    .venv/bin/python benchmarks/bench_quamba.py --quick    # one run of each

Setup (not timed): a seeded random mamba-130m-shaped float checkpoint, exported with
``python -m harness export`` (calibration 8 x 512). Then, each in its own process:

  (q) harness  the main job on the Quamba checkpoint with --mamba_model_path (modes fp32 and 1 need the
               float model): open both, check the pair, run all eight modes to layer 0, compare, write;
  (f) floor    eight bare layer-0 forwards, one per mode, from the same two checkpoints already opened
               (weights prepared once and shared, scales from the checkpoint; no calibration to pay for);
               the same child also times opening the two checkpoints and tokenizing the sample before
               it (reported beside: what (q) pays first and (f) does not).

Target: (q) within 1.3x of (f), and (q) reads only the embedding and layer 0 of the Quamba checkpoint.
Results go to benchmarks/results_quamba.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import MODES, spawn  # noqa: E402



def _child_quamba(a: dict) -> dict:
    from harness.runner.pipeline import RunConfig, run

    cfg = RunConfig(model=Path(a["quamba"]), mamba_model_path=Path(a["float"]), modes=MODES,
                    output_file=Path(a["out"]) / "q.npz", seq_len=a["seq_len"], layers=[0])
    start = time.perf_counter()
    outcome = run(cfg, emit=lambda _s: None)
    seconds = time.perf_counter() - start
    assert not outcome.failed, outcome.failed
    model = outcome.stats["provenance"]["model"]
    return {"seconds": seconds, "bytes_read": model["tensors_read"]["bytes"], "keys_read": model["tensors_read"]["keys"],
            "checkpoint_bytes": model["tensors_read"]["checkpoint_bytes"],
            "float_bytes_read": model["float_model"]["tensors_read"]["bytes"],
            "pairing": model["pairing"]["within_one_code"], "calibration": outcome.stats["provenance"]["calibration"]["source"]}


def _child_floor(a: dict) -> dict:
    from harness.runner.backbone import build_backbone
    from harness.checkpoints.text import DEFAULT_TEXT_FILE, read_sample
    from harness.checkpoints.tokenizer import load_tokenizer
    from harness.recipes.registry import get_mode
    from harness.runner.pairing import checkpoint_calibration, open_models

    opening = time.perf_counter()
    models = open_models(Path(a["quamba"]), Path(a["float"]))
    ids = read_sample(load_tokenizer(a["float"]), DEFAULT_TEXT_FILE, a["seq_len"]).ids
    start = time.perf_counter()
    scales = checkpoint_calibration(models.quamba, 0).scales
    for mode in MODES:
        recipe = get_mode(mode)
        build_backbone(recipe, models.bank, scales if recipe.needs_calibration else None, 0)(ids)
    return {"seconds": time.perf_counter() - start, "open_seconds": start - opening}


CHILDREN = {"quamba": _child_quamba, "floor": _child_floor}



def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one run of each")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--work", type=Path, help="keep the float model and its export in DIR and reuse them on later runs "
                   "(default: a temporary directory, exported anew)")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(CHILDREN[args.child[0]](json.loads(args.child[1]))))
        return 0
    if args.quick:
        args.runs = 1
    from checkpoints import write_random_checkpoint

    from harness.runner.calibration import CalibrationSettings
    from harness.runner.export import ExportConfig, export

    with tempfile.TemporaryDirectory(prefix="bench-quamba-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model, quamba = work / "mamba-130m", work / "quamba-130m-w8a8"
        if not (quamba / "config.json").is_file():
            model = write_random_checkpoint(model, "mamba-130m")
            t = time.perf_counter()
            quamba = export(ExportConfig(model=model, output_dir=quamba, calib=CalibrationSettings(8, 512),
                                         cache_dir=work / "cache"), emit=lambda _s: None)
            print(f"exported {quamba.name} in {time.perf_counter() - t:.1f} s", flush=True)
            os.sync()
        common = {"quamba": str(quamba), "float": str(model), "seq_len": args.seq_len, "out": str(work)}
        runs: dict[str, list[dict]] = {"quamba": [], "floor": []}
        for i in range(args.runs):
            runs["quamba"].append(spawn(__file__, "quamba", common))
            runs["floor"].append(spawn(__file__, "floor", common))
            print(f"  run {i + 1}/{args.runs}: harness {runs['quamba'][-1]['seconds']:.2f} s, "
                  f"floor {runs['floor'][-1]['seconds']:.2f} s", flush=True)
    med = {k: statistics.median(r["seconds"] for r in v) for k, v in runs.items()}
    first = runs["quamba"][0]
    layer0 = all(k.startswith(("backbone.embedding.", "backbone.layers.0.")) for k in first["keys_read"])
    med["floor_with_open"] = statistics.median(r["seconds"] + r["open_seconds"] for r in runs["floor"])
    res = {"seq_len": args.seq_len, "runs": runs, "median_s": med, "ratio": med["quamba"] / med["floor"],
           "ratio_with_open": med["quamba"] / med["floor_with_open"],
           "reads_only_embedding_and_layer0": layer0, "bytes_read": first["bytes_read"],
           "checkpoint_bytes": first["checkpoint_bytes"], "float_bytes_read": first["float_bytes_read"]}
    print(f"\nall 8 modes from the Quamba checkpoint: median {med['quamba']:.2f} s; 8 bare layer-0 forwards: "
          f"{med['floor']:.2f} s -> {res['ratio']:.2f}x (target <= 1.3x); with opening the checkpoints and "
          f"tokenizing first {med['floor_with_open']:.2f} s -> {res['ratio_with_open']:.2f}x")
    print(f"read {first['bytes_read'] / 2**20:.1f} MiB of the {first['checkpoint_bytes'] / 2**20:.1f} MiB checkpoint "
          f"({len(first['keys_read'])} entries, only the embedding and layer 0: {layer0}); float model: "
          f"{first['float_bytes_read'] / 2**20:.1f} MiB; pairing {first['pairing']:.4f} within one code; "
          f"scales from: {first['calibration']}")
    out = Path(__file__).resolve().parent / "results_quamba.json"
    for r in runs["quamba"]:
        r.pop("keys_read")
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
