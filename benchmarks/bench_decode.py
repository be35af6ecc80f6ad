"""Per-step cost of the decode step (issue 23): one mode's step of the whole model against transformers' cached step.

On a mamba-130m-shaped seeded checkpoint: transformers' MambaForCausalLM prefill of --prompt tokens with its cache,
then --steps one-token steps; the harness's fp32 and mode-0 (W8A8, int8 states) backbones plus head, the same
prompt and steps (EmuBackbone.prefill / step). Reports the median seconds per step and the ratio. Mode 0 needs
scales: a small observer pass (4 windows of 32 tokens) stands in for the calibration (its cost is not measured).
Writes benchmarks/results_decode.json. --quick: mamba-130m's width with 4 layers.

--run: the issue's whole-run target, `--decode N` of all eight modes (one capture run: calibration, each mode's
prefill (which hands its state to the steps), steps and consistency prefill, the comparison, the pair written)
against eight runs of transformers' cached decoding (prefill of the prompt with its cache, then N steps, logits
each), side by side --repeat times, medians with min and max; --layers K shrinks the 130m shape to K layers
(default 24: the issue's shape). Writes benchmarks/results_decode_run.json.

--parts: the CPU seconds of each piece per mode (capture prefill, consistency prefill, steps; no head) against
transformers' backbone prefill and steps, on --layers K layers (docs/decode.md "Cost").

--memory N1 N2 ...: the peak RSS (VmHWM) of that capture run at each step count, each in a fresh process, with
the bytes of the decode arrays it stored (memory should grow with N by no more than those). Writes
benchmarks/results_decode_memory.json.
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

import torch  # noqa: E402

from checkpoints import SHAPES, write_random_checkpoint  # noqa: E402
from common import peak_mb, spawn  # noqa: E402


def _median_step(step, ids: torch.Tensor, prompt: int) -> float:
    times = []
    for k in range(prompt, ids.shape[1]):
        t = time.perf_counter()
        step(ids[:, k:k + 1])
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _hf_run_seconds(hf, ids: torch.Tensor, prompt: int) -> tuple[float, float]:
    """One run of transformers' cached decoding: the prompt with its cache, then one token a step. (wall, CPU) s."""
    start, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        cache = hf(input_ids=ids[:, :prompt], use_cache=True).cache_params
        for k in range(prompt, ids.shape[1]):
            cache = hf(input_ids=ids[:, k:k + 1], cache_params=cache, use_cache=True).cache_params
    return time.perf_counter() - start, time.process_time() - cpu


def _harness_run(path: Path, out: Path, prompt: int, steps: int, calib: tuple[int, int]) -> tuple[float, float]:
    """One capture run, `--decode steps` of the eight modes end to end (layer 0 captured): (wall, CPU) seconds."""
    from harness.modes import PRESETS
    from harness.runner.calibration import CalibrationSettings
    from harness.runner.pipeline import RunConfig, run

    cfg = RunConfig(model=path, modes=list(PRESETS["all"]), output_file=out, seq_len=prompt, decode=steps,
                    end_to_end=True, cache_dir=out.parent / "cache",
                    calib=CalibrationSettings(calib[0], calib[1], batch_size=calib[0]))
    start, cpu = time.perf_counter(), time.process_time()
    outcome = run(cfg, emit=lambda _s: None)
    assert not outcome.failed, outcome.failed
    return time.perf_counter() - start, time.process_time() - cpu


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "all": values}


def whole_run(args: argparse.Namespace) -> dict:
    """--run: the harness capture run with --decode of the eight modes against eight transformers runs, side by
    side --repeat times (alternating, so both see the same load); medians with min and max."""
    from transformers import MambaForCausalLM

    from harness.checkpoints.tokenizer import load_tokenizer
    from harness.checkpoints.text import DEFAULT_TEXT_FILE, read_sample
    from harness.modes import PRESETS

    SHAPES["run"] = (SHAPES["mamba-130m"][0], args.layers)
    calib = (args.calib_samples, args.calib_seqlen)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(Path(tmp) / "m", "run")
        ids = read_sample(load_tokenizer(path), DEFAULT_TEXT_FILE, args.prompt + args.steps).ids.reshape(1, -1)
        hf = MambaForCausalLM.from_pretrained(path).eval()
        eight, ours = [], []
        for r in range(args.repeat):
            runs = [_hf_run_seconds(hf, ids, args.prompt) for _ in range(8)]
            eight.append((sum(w for w, _ in runs), sum(c for _, c in runs)))
            ours.append(_harness_run(path, Path(tmp) / f"d{r}.npz", args.prompt, args.steps, calib))
            (Path(tmp) / f"d{r}.npz").unlink()
    cpu = {"transformers_eight_runs_cpu_s": _spread([c for _, c in eight]),
           "harness_run_cpu_s": _spread([c for _, c in ours]),
           "ratio_cpu": statistics.median(c for _, c in ours) / statistics.median(c for _, c in eight)}
    eight, ours = [w for w, _ in eight], [w for w, _ in ours]
    ratios = [h / t for h, t in zip(ours, eight)]
    return {**cpu, "shape": f"d_model {SHAPES['run'][0]}, {args.layers} layers", "prompt": args.prompt,
            "steps": args.steps,
            "modes": list(PRESETS["all"]), "threads": torch.get_num_threads(), "calibration": list(calib),
            "repeat": args.repeat, "load_average": list(os.getloadavg()),
            "transformers_eight_runs_s": _spread(eight), "harness_run_s": _spread(ours),
            "ratio": statistics.median(ours) / statistics.median(eight), "ratio_per_repeat": _spread(ratios)}


def parts(args: argparse.Namespace) -> dict:
    """--parts: CPU seconds of each piece of a --decode run per mode (capture prefill over the prompt, consistency
    prefill over prompt + steps, the steps), without the head, against transformers' backbone prefill and steps."""
    from transformers import MambaForCausalLM

    from harness.checkpoints.loading import open_checkpoint
    from harness.runner.backbone import build_backbone
    from harness.modes import BUILTIN_MODES
    from harness.recipes.quamba.calibration import run_observers
    from harness.runner.weightbank import WeightBank

    def cpu(fn) -> tuple[float, object]:
        start = time.process_time()
        out = fn()
        return time.process_time() - start, out

    SHAPES["parts"] = (SHAPES["mamba-130m"][0], args.layers)
    L, depth = args.prompt, args.layers - 1
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        path = write_random_checkpoint(Path(tmp) / "m", "parts")
        ids = torch.randint(0, 50000, (1, L + args.steps), generator=torch.Generator().manual_seed(0))
        hf = MambaForCausalLM.from_pretrained(path).eval().backbone
        t_pre, cache = cpu(lambda: hf(input_ids=ids[:, :L], use_cache=True).cache_params)

        def hf_steps(cache=cache):
            for k in range(L, ids.shape[1]):
                cache = hf(input_ids=ids[:, k:k + 1], cache_params=cache, use_cache=True).cache_params
        out = {"shape": f"d_model {SHAPES['parts'][0]}, {args.layers} layers", "prompt": L, "steps": args.steps,
               "transformers": {"prefill_cpu_s": t_pre, "steps_cpu_s": cpu(hf_steps)[0]}}
        bank = WeightBank(open_checkpoint(path))
        windows = torch.randint(0, 50000, (4, 32), generator=torch.Generator().manual_seed(1))
        scales, _ = run_observers(bank, windows, depth, 0.9995, 4)
        for mode in args.modes:
            recipe = BUILTIN_MODES[mode]
            model = build_backbone(recipe, bank, scales if recipe.needs_calibration else None, depth)
            t_l, (_, states) = cpu(lambda: model.prefill(ids[:, :L]))
            t_full, _ = cpu(lambda: model(ids))

            def steps(states=states, model=model):
                for k in range(L, ids.shape[1]):
                    _, states = model.step(ids[:, k:k + 1], states)
            out[f"mode_{mode}"] = {"prefill_cpu_s": t_l, "consistency_prefill_cpu_s": t_full,
                                   "steps_cpu_s": cpu(steps)[0]}
    return out


def _child_memory(a: dict) -> dict:
    """One harness run in this fresh process: its peak RSS and the bytes of the decode arrays it stored."""
    import numpy as np

    SHAPES["run"] = (SHAPES["mamba-130m"][0], a["layers"])
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(Path(tmp) / "m", "run")
        out = Path(tmp) / "d.npz"
        seconds = _harness_run(path, out, a["prompt"], a["steps"], tuple(a["calib"]))[0]
        with np.load(out, allow_pickle=False) as z:
            decode_bytes = sum(z[k].nbytes for k in z.files if "__decode." in k)
    return {"steps": a["steps"], "peak_mb": peak_mb(), "decode_arrays_mb": decode_bytes / 2**20,
            "seconds": seconds}


def memory(args: argparse.Namespace) -> dict:
    """--parts: the CPU seconds of each piece per mode (capture prefill, consistency prefill, steps; no head) against
transformers' backbone prefill and steps, on --layers K layers (docs/decode.md "Cost").

--memory N1 N2 ...: the peak RSS of a --run capture at each step count, each in its own process."""
    rows = [spawn(__file__, "memory", {"layers": args.layers, "prompt": args.prompt, "steps": n,
                                       "calib": [args.calib_samples, args.calib_seqlen]}) for n in args.memory]
    return {"shape": f"d_model {SHAPES['mamba-130m'][0]}, {args.layers} layers", "prompt": args.prompt,
            "load_average": list(os.getloadavg()), "runs": rows}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--run", action="store_true", help="the whole --decode run of the eight modes (module docstring)")
    p.add_argument("--layers", type=int, default=24, help="with --run: layers of the 130m-wide model")
    p.add_argument("--calib_samples", type=int, default=4, help="with --run: calibration windows")
    p.add_argument("--calib_seqlen", type=int, default=64, help="with --run: calibration window length")
    p.add_argument("--repeat", type=int, default=3, help="with --run: side-by-side repetitions (medians)")
    p.add_argument("--memory", type=int, nargs="+", help="peak RSS of a --run capture at these step counts")
    p.add_argument("--parts", action="store_true", help="CPU seconds of each piece of a --decode run per mode")
    p.add_argument("--modes", nargs="+", default=["fp32", "0", "3"], help="with --parts: the modes")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps({"memory": _child_memory}[args.child[0]](json.loads(args.child[1]))))
        return
    if args.parts:
        print(json.dumps(parts(args), indent=1))
        return
    if args.run or args.memory:
        results = whole_run(args) if args.run else memory(args)
        name = "results_decode_run.json" if args.run else "results_decode_memory.json"
        out = Path(__file__).resolve().parent / name
        out.write_text(json.dumps(results, indent=1))
        print(json.dumps(results, indent=1))
        return
    from transformers import MambaForCausalLM

    from harness.checkpoints.loading import open_checkpoint
    from harness.runner.backbone import build_backbone
    from harness.modes import BUILTIN_MODES
    from harness.recipes.quamba.calibration import run_observers
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
