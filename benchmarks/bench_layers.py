"""Every layer, isolated and end to end, against transformers' own fp32 forward (issue 9's targets).

Side by side on a mamba-130m-shaped seeded checkpoint (seq 512), each measurement in its own
process, wall and CPU time (the machine is shared: CPU time is the steadier number):

  hf         transformers' fp32 MambaForCausalLM forward (logits), one sample
  one_mode   the emulation's fp32 mode through all 24 blocks, the final norm and lm_head
  calibrate  calibration of all 24 layers (cold cache)
  hf_calib   one transformers forward over the same calibration tokens (the "one calibration
             forward pass of the whole model")
  all        the main job: all eight modes, --layers all --isolated --end-to-end, calibration cached;
             peak RSS of the process
  all_taps   the same with --taps all and --stats-only (the peak-memory target)

hf and all run --runs times (default 3), alternating, after the others (calibrate fills the cache
that all reuses): medians, and their spread as [min, max]; the ratios are of the medians.
The transformers children import nothing of the harness (the token ids come from the parent in a
.npy file): the harness sets glibc's malloc thresholds when imported (harness/memory.py), and the
baseline is transformers as its users run it. Writes benchmarks/results_layers.json.
--quick: a small shape and short sequences, one run (smoke run).
"""
from __future__ import annotations

import argparse
import json
import os
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




def _timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, {"wall_s": round(time.perf_counter() - wall, 3), "cpu_s": round(time.process_time() - cpu, 3)}


def _write_ids(model: Path, seq_len: int, calib: tuple[int, int], work: Path) -> None:
    """The sample's and the calibration windows' token ids, as the harness reads them, for every child."""
    import numpy as np

    from harness.runner.calibration import CalibrationSettings
    from harness.checkpoints.text import DEFAULT_CALIB_FILE, DEFAULT_TEXT_FILE, calibration_windows, read_sample
    from harness.checkpoints.tokenizer import load_tokenizer

    tok, settings = load_tokenizer(model), CalibrationSettings(*calib)
    np.save(work / "ids.npy", read_sample(tok, DEFAULT_TEXT_FILE, seq_len).ids.numpy())
    windows = calibration_windows(tok, DEFAULT_CALIB_FILE, settings.num_samples, settings.seqlen, settings.seed)
    np.save(work / "calib_ids.npy", windows.ids.numpy())
    np.save(work / "calib_batch.npy", np.array(settings.batch_size))


def _ids(a: dict, name: str = "ids"):
    import numpy as np
    import torch

    return torch.from_numpy(np.load(Path(a["out"]) / f"{name}.npy", allow_pickle=False))


def _plain_transformers() -> dict:
    return {"harness_imported": any(m == "harness" or m.startswith("harness.") for m in sys.modules)}


def _hf_class(a: dict):
    """transformers' model class of the benchmark (a["hf_class"], default MambaForCausalLM)."""
    import transformers

    return getattr(transformers, a.get("hf_class", "MambaForCausalLM"))


def _child_hf(a: dict) -> dict:
    import torch

    model = _hf_class(a).from_pretrained(a["model"], dtype=torch.float32).eval()
    ids = _ids(a)
    with torch.no_grad():
        model(input_ids=ids[:, :16])  # warm-up
        _, t = _timed(lambda: model(input_ids=ids).logits)
    return {**t, **_plain_transformers()}


def _child_hf_calib(a: dict) -> dict:
    import torch

    hf = _hf_class(a).from_pretrained(a["model"], dtype=torch.float32).eval()
    ids, batch = _ids(a, "calib_ids"), int(_ids(a, "calib_batch"))
    with torch.no_grad():
        _, f = _timed(lambda: [hf(input_ids=ids[k:k + batch]).logits for k in range(0, ids.shape[0], batch)])
    return {**f, **_plain_transformers()}


def _child_one_mode(a: dict) -> dict:
    import torch

    from harness.runner.forwards import build_head
    from harness.runner.backbone import build_backbone
    from harness.recipes.registry import resolve_modes
    from harness.runner.pairing import open_models

    models = open_models(Path(a["model"]), None)
    (recipe,) = resolve_modes(["fp32"], None)
    ids = _ids(a)
    n = models.bank.dims.n_layer

    def forward():
        model = build_backbone(recipe, models.bank, None, n - 1)
        with torch.no_grad():
            return build_head(recipe, models.bank)(model(ids))
    _, prep = _timed(forward)  # first call also prepares (reads, rotates) the weights
    _, t = _timed(forward)
    return {**t, "first_call_with_weight_preparation": prep}


def _child_calibrate(a: dict) -> dict:
    from harness.runner.calibration import CalibrationSettings
    from harness.recipes.quamba.families import calibrate_key as calibrate
    from harness.runner.pairing import open_models

    models = open_models(Path(a["model"]), None)
    settings = CalibrationSettings(a["calib_samples"], a["calib_seqlen"])
    n = models.bank.dims.n_layer
    prefix = models.primary.prefix_hashes(n - 1)
    ids = _ids(a, "calib_ids")
    _, t = _timed(lambda: calibrate(models.bank, ids, settings, n - 1, prefix, Path(a["cache"])))
    return t


def _child_all(a: dict, taps_all: bool = False) -> dict:
    from harness.runner.calibration import CalibrationSettings
    from harness.runner.pipeline import RunConfig, run

    cfg = RunConfig(model=Path(a["model"]), modes=a["modes"], output_file=Path(a["out"]) / "all.npz",
                    seq_len=a["seq_len"], calib=CalibrationSettings(a["calib_samples"], a["calib_seqlen"]),
                    cache_dir=Path(a["cache"]), layers=["all"], taps=["all"] if taps_all else [],
                    isolated=True, end_to_end=True, keep_arrays=False, stats_only=taps_all)
    outcome, t = _timed(lambda: run(cfg, emit=lambda _s: None))
    assert not outcome.failed, outcome.failed
    return {**t, "calibration": outcome.stats["provenance"]["calibration"]["source"],
            "npz_mb": round(os.path.getsize(cfg.output_file) / 2**20, 1)}


def _child_all_taps(a: dict) -> dict:
    return _child_all(a, taps_all=True)


def _summary(runs: list[dict]) -> dict:
    """Median wall and CPU seconds of the runs, their [min, max], and every run."""
    out: dict = {k: statistics.median(r[k] for r in runs) for k in ("wall_s", "cpu_s")}
    out["spread"] = {k: [min(r[k] for r in runs), max(r[k] for r in runs)] for k in ("wall_s", "cpu_s")}
    return {**out, "runs": runs}


CHILDREN = {"hf": _child_hf, "one_mode": _child_one_mode, "calibrate": _child_calibrate,
            "hf_calib": _child_hf_calib, "all": _child_all, "all_taps": _child_all_taps}



def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small shape, short sequences (smoke run)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--calib-samples", type=int, default=8)
    p.add_argument("--calib-seqlen", type=int, default=512)
    p.add_argument("--runs", type=int, default=3, help="alternating runs of hf and all")
    p.add_argument("--only", nargs="+", choices=list(CHILDREN), default=list(CHILDREN), help="measure only these")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        run_child(args.child, CHILDREN)
        return 0
    shape = "mamba-130m"
    if args.quick:
        args.seq_len, args.calib_samples, args.calib_seqlen, shape, args.runs = 64, 2, 64, "mamba-130m", 1
    from checkpoints import write_random_checkpoint

    res: dict = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                             "loadavg_before": os.getloadavg()},
                 "shape": shape, "seq_len": args.seq_len, "calib": [args.calib_samples, args.calib_seqlen],
                 "modes": MODES, "quick": args.quick}
    with tempfile.TemporaryDirectory(prefix="bench-layers-") as tmp:
        work = Path(tmp)
        model = write_random_checkpoint(work / shape, shape)
        _write_ids(model, args.seq_len, (args.calib_samples, args.calib_seqlen), work)
        common = {"model": str(model), "seq_len": args.seq_len, "calib_samples": args.calib_samples,
                  "calib_seqlen": args.calib_seqlen, "cache": str(work / "cache"), "out": str(work),
                  "modes": MODES}
        repeated = [k for k in ("hf", "all") if k in args.only]
        for kind in [k for k in CHILDREN if k in args.only and k not in repeated]:
            res[kind] = spawn(__file__, kind, common)
            print(kind, json.dumps(res[kind]), flush=True)
        runs: dict[str, list[dict]] = {k: [] for k in repeated}
        for i in range(args.runs):
            for kind in repeated:
                runs[kind].append(spawn(__file__, kind, common))
                print(f"{kind} run {i + 1}/{args.runs}", json.dumps(runs[kind][-1]), flush=True)
        res.update({kind: _summary(r) for kind, r in runs.items()})
    hf = res.get("hf")
    if hf and "one_mode" in res:
        res["one_mode_over_hf"] = {k: round(res["one_mode"][k] / hf[k], 3) for k in ("wall_s", "cpu_s")}
    if hf and "all" in res:
        res["all_over_8_hf"] = {k: round(res["all"][k] / (8 * hf[k]), 3) for k in ("wall_s", "cpu_s")}
    if "calibrate" in res and "hf_calib" in res:
        res["calibration_over_one_forward"] = {k: round(res["calibrate"][k] / res["hf_calib"][k], 3)
                                               for k in ("wall_s", "cpu_s")}
    res["machine"]["loadavg_after"] = os.getloadavg()
    out = Path(__file__).resolve().parent / ("results_layers_quick.json" if args.quick else "results_layers.json")
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k.endswith(("_hf", "_forward"))}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
