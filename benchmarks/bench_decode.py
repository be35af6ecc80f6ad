"""Per-step cost of the decode step (issue 23): one mode's step of the whole model against transformers' cached step.

On a mamba-130m-shaped seeded checkpoint: transformers' MambaForCausalLM prefill of --prompt tokens with its cache,
then --steps one-token steps; the harness's fp32 and mode-0 (W8A8, int8 states) backbones plus head, the same
prompt and steps (EmuBackbone.prefill / step). Reports the median seconds per step and the ratio. Mode 0 needs
scales: a small observer pass (4 windows of 32 tokens) stands in for the calibration (its cost is not measured).
Writes benchmarks/results_decode.json. --quick: mamba-130m's width with 4 layers.

--run: the issue's whole-run target, `--decode N` of all eight modes (one capture run: calibration, each mode's
prefill, steps and consistency prefill, the comparison, the pair written) against eight runs of transformers'
cached decoding (prefill of the prompt with its cache, then N steps, logits each); --layers K shrinks the
130m shape to K layers (docs/performance.md extrapolates). Writes benchmarks/results_decode_run.json.
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


def _hf_run_seconds(path: Path, ids: torch.Tensor, prompt: int) -> float:
    """One run of transformers' cached decoding: the prompt with its cache, then one token a step."""
    from transformers import MambaForCausalLM

    hf = MambaForCausalLM.from_pretrained(path).eval()
    start = time.perf_counter()
    with torch.no_grad():
        cache = hf(input_ids=ids[:, :prompt], use_cache=True).cache_params
        for k in range(prompt, ids.shape[1]):
            cache = hf(input_ids=ids[:, k:k + 1], cache_params=cache, use_cache=True).cache_params
    return time.perf_counter() - start


def whole_run(args: argparse.Namespace) -> dict:
    """--run: one harness capture run with --decode of the eight modes against eight transformers runs."""
    from harness.checkpoints.loading import load_tokenizer
    from harness.checkpoints.text import DEFAULT_TEXT_FILE, read_sample
    from harness.modes import PRESETS
    from harness.runner.calibration import CalibrationSettings
    from harness.runner.pipeline import RunConfig, run

    SHAPES["run"] = (SHAPES["mamba-130m"][0], args.layers)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(Path(tmp) / "m", "run")
        ids = read_sample(load_tokenizer(path), DEFAULT_TEXT_FILE, args.prompt + args.steps).ids.reshape(1, -1)
        hf_s = _hf_run_seconds(path, ids, args.prompt)
        cfg = RunConfig(model=path, modes=list(PRESETS["all"]), output_file=Path(tmp) / "d.npz", seq_len=args.prompt,
                        decode=args.steps, end_to_end=True, cache_dir=Path(tmp) / "cache",
                        calib=CalibrationSettings(args.calib_samples, args.calib_seqlen, batch_size=args.calib_samples))
        start = time.perf_counter()
        outcome = run(cfg, emit=lambda _s: None)
        harness_s = time.perf_counter() - start
        assert not outcome.failed, outcome.failed
    return {"shape": f"d_model {SHAPES['run'][0]}, {args.layers} layers", "prompt": args.prompt, "steps": args.steps,
            "modes": list(PRESETS["all"]), "threads": torch.get_num_threads(),
            "calibration": [args.calib_samples, args.calib_seqlen], "transformers_one_run_s": hf_s,
            "transformers_eight_runs_s": 8 * hf_s, "harness_run_s": harness_s, "ratio": harness_s / (8 * hf_s)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--run", action="store_true", help="the whole --decode run of the eight modes (module docstring)")
    p.add_argument("--layers", type=int, default=24, help="with --run: layers of the 130m-wide model")
    p.add_argument("--calib_samples", type=int, default=4, help="with --run: calibration windows")
    p.add_argument("--calib_seqlen", type=int, default=64, help="with --run: calibration window length")
    args = p.parse_args()
    if args.run:
        results = whole_run(args)
        out = Path(__file__).resolve().parent / "results_decode_run.json"
        out.write_text(json.dumps(results, indent=1))
        print(json.dumps(results, indent=1))
        return
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
