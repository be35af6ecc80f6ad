"""Mamba-2: every layer, isolated and end to end, against transformers' own fp32 forward (issue 22's targets).

Side by side on a mamba2-130m-shaped seeded checkpoint (benchmarks/checkpoints_mamba2.py; seq 512), each
measurement in its own process, wall and CPU time (the machine may be shared: CPU time is the steadier number):

  hf         transformers' fp32 Mamba2ForCausalLM forward (its torch path on CPU; logits), one sample
  one_mode   one mode of the emulation (--one-modes, default fp32 and q2-w8a8) through all blocks, the final
             norm and lm_head, built once (first_build: the weight preparation; second_build: a build again);
             q2-w8a8's calibration is read from the cache before the clock starts
  calibrate  Quamba2's calibration of all layers (two passes, cold cache; fills the cache for the others)
  hf_calib   one transformers forward over the same calibration tokens
  all        the main job: the `all` preset on the Mamba-2 model (every built-in Mamba-2 mode),
             --layers all --isolated --end-to-end, calibration cached; peak RSS of the process

hf and all run --runs times (default 3), alternating, after the others and after one unmeasured `all` that fills
the calibration and GPTQ caches (the W4 modes' GPTQ is their calibration): medians, and their spread as [min, max];
the ratios are of the medians. Targets: one mode <= 0.5x hf; all <= 2x (modes x hf); peak of all < 2 GB.
The transformers children import nothing of the harness (token ids come from the parent in a .npy file).
Writes benchmarks/results_mamba2.json (--quick: results_mamba2_quick.json).
--quick: 2 layers, seq 128, calibration 2 x 128, one run (smoke run); --n-layer and --seq-len set them otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_layers import _child_hf, _child_hf_calib, _ids, _summary, _timed, _write_ids  # noqa: E402
from common import run_child, spawn  # noqa: E402


def _calibration(models, a: dict, prep: str):
    from harness.runner.calibration import CalibrationSettings
    from harness.recipes.quamba.families import calibrate_key as calibrate

    n = models.bank.dims.n_layer
    settings = CalibrationSettings(a["calib_samples"], a["calib_seqlen"])
    return calibrate(models.bank, _ids(a, "calib_ids"), settings, n - 1, models.primary.prefix_hashes(n - 1),
                     Path(a["cache"]), prep)


def _child_one_mode(a: dict) -> dict:
    import torch

    from harness.runner.backbone import build_backbone
    from harness.recipes.registry import resolve_modes
    from harness.runner.forwards import build_head
    from harness.runner.pairing import open_models

    models = open_models(Path(a["model"]), None)
    (recipe,) = resolve_modes([a["mode"]], None, models.bank.dims.architecture)
    scales = _calibration(models, a, str(recipe.prep)).scales if recipe.needs_calibration else None
    ids = _ids(a)
    n = models.bank.dims.n_layer

    def build():
        return build_backbone(recipe, models.bank, scales, n - 1), build_head(recipe, models.bank)

    def forward(model, head):
        with torch.no_grad():
            return head(model(ids))
    (model, head), prep = _timed(build)  # the first build prepares (reads, folds, rotates, quantizes) the weights
    forward(model, head)
    _, t = _timed(lambda: forward(model, head))
    _, again = _timed(build)  # a second build: what the bank keeps is not prepared again (q2 blocks are)
    return {**t, "mode": a["mode"], "first_build": prep, "second_build": again}


def _child_calibrate(a: dict) -> dict:
    from harness.runner.pairing import open_models

    models = open_models(Path(a["model"]), None)
    result, t = _timed(lambda: _calibration(models, a, "quamba2"))
    return {**t, "source": result.info["source"]}


def _child_all(a: dict) -> dict:
    from harness.runner.calibration import CalibrationSettings
    from harness.runner.pipeline import RunConfig, run

    cfg = RunConfig(model=Path(a["model"]), modes=["all"], output_file=Path(a["out"]) / "all.npz",
                    seq_len=a["seq_len"], calib=CalibrationSettings(a["calib_samples"], a["calib_seqlen"]),
                    cache_dir=Path(a["cache"]), layers=["all"], isolated=True, end_to_end=True, keep_arrays=False)
    outcome, t = _timed(lambda: run(cfg, emit=lambda _s: None))
    assert not outcome.failed, outcome.failed
    calib = outcome.stats["provenance"]["calibration_by_prep"]
    return {**t, "modes": list(outcome.stats["modes"]), "calibration": {p: c["source"] for p, c in calib.items()},
            "npz_mb": round(os.path.getsize(cfg.output_file) / 2**20, 1)}


CHILDREN = {"hf": _child_hf, "calibrate": _child_calibrate, "one_mode": _child_one_mode, "hf_calib": _child_hf_calib,
            "all": _child_all}


def _ratios(res: dict) -> None:
    hf = res.get("hf")
    if not hf:
        return
    for mode, r in res.get("one_mode", {}).items():
        res.setdefault("one_mode_over_hf", {})[mode] = {k: round(r[k] / hf[k], 3) for k in ("wall_s", "cpu_s")}
    if "all" in res:
        n = len(res["all"]["runs"][0]["modes"])
        res["all_over_modes_x_hf"] = {"modes": n, **{k: round(res["all"][k] / (n * hf[k]), 3) for k in ("wall_s", "cpu_s")}}
        res["all_peak_mb"] = max(r["peak_mb"] for r in res["all"]["runs"])
    if "calibrate" in res and "hf_calib" in res:
        res["calibration_over_one_forward"] = {k: round(res["calibrate"][k] / res["hf_calib"][k], 3)
                                               for k in ("wall_s", "cpu_s")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 layers, short sequences, one run (smoke run)")
    p.add_argument("--n-layer", type=int, default=24, help="layers of the seeded model (default 24, as mamba2-130m)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--calib-samples", type=int, default=8)
    p.add_argument("--calib-seqlen", type=int, default=512)
    p.add_argument("--runs", type=int, default=3, help="alternating runs of hf and all")
    p.add_argument("--one-modes", nargs="+", default=["fp32", "q2-w8a8"], help="modes of one_mode")
    p.add_argument("--only", nargs="+", choices=list(CHILDREN), default=list(CHILDREN), help="measure only these")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        run_child(args.child, CHILDREN)
        return 0
    if args.quick:
        args.n_layer, args.seq_len, args.calib_samples, args.calib_seqlen, args.runs = 2, 128, 2, 128, 1
    from checkpoints_mamba2 import write_random_mamba2

    res: dict = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg_before": os.getloadavg()},
                 "shape": "mamba2-130m", "n_layer": args.n_layer, "seq_len": args.seq_len,
                 "calib": [args.calib_samples, args.calib_seqlen], "quick": args.quick}
    with tempfile.TemporaryDirectory(prefix="bench-mamba2-") as tmp:
        work = Path(tmp)
        model = write_random_mamba2(work / "mamba2-130m", args.n_layer)
        _write_ids(model, args.seq_len, (args.calib_samples, args.calib_seqlen), work)
        common = {"model": str(model), "hf_class": "Mamba2ForCausalLM", "seq_len": args.seq_len,
                  "calib_samples": args.calib_samples,
                  "calib_seqlen": args.calib_seqlen, "cache": str(work / "cache"), "out": str(work)}
        repeated = [k for k in ("hf", "all") if k in args.only]
        for kind in [k for k in CHILDREN if k in args.only and k not in repeated]:
            if kind == "one_mode":
                res[kind] = {m: spawn(__file__, kind, {**common, "mode": m}) for m in args.one_modes}
            else:
                res[kind] = spawn(__file__, kind, common)
            print(kind, json.dumps(res[kind]), flush=True)
        if "all" in repeated:  # the W4 modes' GPTQ is calibration too: fill the cache before the measured runs
            res["all_warmup"] = spawn(__file__, "all", common)
            print("all warm-up (fills the calibration and GPTQ caches)", json.dumps(res["all_warmup"]), flush=True)
        runs: dict[str, list[dict]] = {k: [] for k in repeated}
        for i in range(args.runs):
            for kind in repeated:
                runs[kind].append(spawn(__file__, kind, common))
                print(f"{kind} run {i + 1}/{args.runs}", json.dumps(runs[kind][-1]), flush=True)
        res.update({kind: _summary(r) for kind, r in runs.items()})
    _ratios(res)
    res["machine"]["loadavg_after"] = os.getloadavg()
    out = Path(__file__).resolve().parent / ("results_mamba2_quick.json" if args.quick else "results_mamba2.json")
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k.endswith(("_hf", "_forward", "peak_mb"))}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
