"""One mode through a 130m-shaped Bamba hybrid against transformers' fp32 forward (issue 34's target: <= 1.5x).

A seeded BambaForCausalLM (tests/fixtures/bamba_fixtures.make_bamba): d_model 768, --n-layer layers (default 24)
with attention at every sixth (Granite 4.0-H's ratio), MLP width 2048, 24 Mamba-2 heads of 64, d_state 128,
chunk 256, vocab 50280; one sample of --seq-len tokens (default 512). Each side in its own process, one torch
thread, alternating --runs times (medians, [min, max]): transformers' forward (eager attention, its torch SSD) and
each --modes mode (default fp32 and q2-w8a8) through every block, norm_f and lm_head, built and calibrated
(4 x 256 tokens, cached) before the clock. Writes benchmarks/results_hybrid.json (not committed).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))

from common import run_child, spawn  # noqa: E402


def _ids(a: dict):
    import torch

    return torch.randint(0, 50000, (1, a["seq_len"]), generator=torch.Generator().manual_seed(0))


def _timed(fn) -> dict:
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}


def _child_build(a: dict) -> dict:
    from bamba_fixtures import make_bamba

    n = a["n_layer"]
    make_bamba(Path(a["model"]), layers=n, attn=tuple(range(5, n, 6)), d_model=768, d_ff=2048, heads=12, kv_heads=4,
               ngroups=1, d_state=128, chunk=256, vocab=50280)
    return {}


def _child_hf(a: dict) -> dict:
    import torch
    from transformers import BambaForCausalLM

    torch.set_num_threads(1)
    model = BambaForCausalLM.from_pretrained(a["model"], dtype=torch.float32, attn_implementation="eager").eval()
    ids = _ids(a)
    with torch.no_grad():
        model(input_ids=ids[:, :16])
        return _timed(lambda: model(input_ids=ids).logits)


def _child_mode(a: dict) -> dict:
    import torch

    from harness.recipes.registry import resolve_modes
    from harness.runner.backbone import build_backbone
    from harness.runner.calibration import CalibrationSettings
    from harness.runner.forwards import build_head
    from harness.runner.pairing import open_models

    torch.set_num_threads(1)
    models = open_models(Path(a["model"]), None)
    bank = models.bank
    n = bank.dims.n_layer
    (recipe,) = resolve_modes([a["mode"]], None, bank.dims.architecture)
    scales = None
    if recipe.needs_calibration:
        from harness.recipes.registry import recipe_for

        windows = torch.randint(0, 50000, (4, 256), generator=torch.Generator().manual_seed(1))
        family = recipe_for(recipe)
        scales = family.calibrate(family.calibration_key(recipe), bank, windows, CalibrationSettings(4, 256), n - 1,
                                  models.primary.prefix_hashes(n - 1), Path(a["cache"])).scales
    model, head = build_backbone(recipe, bank, scales, n - 1), build_head(recipe, bank)
    ids = _ids(a)
    with torch.no_grad():
        head(model(ids[:, :16]))
        return _timed(lambda: head(model(ids)))


CHILDREN = {"build": _child_build, "hf": _child_hf, "mode": _child_mode}


def _summary(runs: list[dict]) -> dict:
    return {k: {"median": statistics.median(r[k] for r in runs), "min": min(r[k] for r in runs),
                "max": max(r[k] for r in runs)} for k in ("wall_s", "cpu_s")}


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        run_child(sys.argv[2:], CHILDREN)
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-layer", type=int, default=24)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--modes", nargs="+", default=["fp32", "q2-w8a8"])
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results_hybrid.json")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as work:
        args = {"model": str(Path(work) / "bamba-130m"), "n_layer": a.n_layer, "seq_len": a.seq_len,
                "cache": str(Path(work) / "cache")}
        spawn(__file__, "build", args)
        runs: dict[str, list[dict]] = {"hf": [], **{m: [] for m in a.modes}}
        for _ in range(a.runs):
            runs["hf"].append(spawn(__file__, "hf", args))
            for mode in a.modes:
                runs[mode].append(spawn(__file__, "mode", {**args, "mode": mode}))
    result = {"n_layer": a.n_layer, "seq_len": a.seq_len, **{k: _summary(v) for k, v in runs.items()}}
    hf = result["hf"]["cpu_s"]["median"]
    result["ratio_cpu"] = {m: result[m]["cpu_s"]["median"] / hf for m in a.modes}
    a.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
