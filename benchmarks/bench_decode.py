"""Per-step cost of the decode step (issue 23): one mode's step of the whole model against transformers' cached step.

On a mamba-130m-shaped seeded checkpoint: transformers' MambaForCausalLM prefill of --prompt tokens with its cache,
then --steps one-token steps; the harness's fp32 and mode-0 (W8A8, int8 states) backbones plus head, the same
prompt and steps (EmuBackbone.prefill / step). Reports the median seconds per step and the ratio. Mode 0 needs
scales: a small observer pass (4 windows of 32 tokens) stands in for the calibration (its cost is not measured).
Writes benchmarks/results_decode.json. --quick: mamba-130m's width with 4 layers.
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

import torch  # noqa: E402

from checkpoints import SHAPES, write_random_checkpoint  # noqa: E402


def _median_step(step, ids: torch.Tensor, prompt: int) -> float:
    times = []
    for k in range(prompt, ids.shape[1]):
        t = time.perf_counter()
        step(ids[:, k:k + 1])
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    from transformers import MambaForCausalLM

    from harness.checkpoints.loading import open_checkpoint
    from harness.emulation.build import build_backbone
    from harness.modes import BUILTIN_MODES
    from harness.runner.calibration import run_observers
    from harness.runner.forwards import build_head
    from harness.runner.weightbank import WeightBank

    if args.quick:
        SHAPES["quick"] = (SHAPES["mamba-130m"][0], 4)
    shape = "quick" if args.quick else "mamba-130m"
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(Path(tmp) / "m", shape)
        ids = torch.randint(0, 50000, (1, args.prompt + args.steps), generator=torch.Generator().manual_seed(0))
        hf = MambaForCausalLM.from_pretrained(path).eval()
        results = {"shape": shape, "prompt": args.prompt, "steps": args.steps, "threads": torch.get_num_threads()}
        with torch.no_grad():
            cache = [hf(input_ids=ids[:, :args.prompt], use_cache=True).cache_params]

            def hf_step(tok):
                cache[0] = hf(input_ids=tok, cache_params=cache[0], use_cache=True).cache_params
            results["transformers_s_per_step"] = _median_step(hf_step, ids, args.prompt)
        bank = WeightBank(open_checkpoint(path))
        windows = torch.randint(0, 50000, (4, 32), generator=torch.Generator().manual_seed(1))
        scales, _ = run_observers(bank, windows, bank.dims.n_layer - 1, 0.9995, 4)
        for mode in ("fp32", "0"):
            recipe = BUILTIN_MODES[mode]
            model = build_backbone(recipe, bank, scales if recipe.needs_calibration else None, bank.dims.n_layer - 1)
            head = build_head(recipe, bank)
            state = [model.prefill(ids[:, :args.prompt])[1]]

            def step(tok, model=model, head=head, state=state):
                residual, state[0] = model.step(tok, state[0])
                head(residual)
            results[f"mode_{mode}_s_per_step"] = _median_step(step, ids, args.prompt)
            results[f"mode_{mode}_ratio"] = results[f"mode_{mode}_s_per_step"] / results["transformers_s_per_step"]
    out = Path(__file__).resolve().parent / "results_decode.json"
    out.write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
