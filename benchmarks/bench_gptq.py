"""GPTQ time of Quamba2's W4 recipes (emulation.q2_gptq) and its ratio to one calibration forward.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_gptq.py [--layers 24] [--calib-samples 4] [--calib-seqlen 256]
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_gptq.py --arch mamba1 [--layers 24] ...

--arch mamba1: the same on a mamba-130m-shaped Mamba-1 (benchmarks/checkpoints.py, d_model 768): the prep=quamba
calibration model, GPTQ as q2-w4a16 runs it there (emulation.mamba1_gptq), and one forward of a 512-token sequence
through the --layers blocks of modes 0, q2-w4a8 and q2-w4a16 (their weights and scales prepared first).

On a mamba2-130m-shaped seeded checkpoint (d_model 768, headdim 64, d_state 128, ngroups 1, chunk 256; vocab 1024
to keep the embedding small, the blocks are 130m's), over --calib-samples x --calib-seqlen random tokens:

* one calibration forward: the rotated fp16 Mamba-2 (Q2_CALIBRATION_RECIPE) through the --layers blocks;
* GPTQ as q2-w4a16 runs it: per block a forward feeding the two Hessians, GPTQ of in_proj (3352 x 768) and
  out_proj (768 x 1536), a forward with the GPTQ weights (gptq_q2, float32 as Quamba).

Prints one JSON line (seconds, the ratio, per-layer seconds). Nothing is written but the temporary model.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness.checkpoints.loading import open_checkpoint  # noqa: E402
from harness.runner.backbone import build_backbone  # noqa: E402
from harness.recipes.quamba.w4.gptq_mamba2 import gptq_q2  # noqa: E402
from harness.modes import Q2_CALIBRATION_RECIPE  # noqa: E402
from harness.runner.weightbank import WeightBank  # noqa: E402


def _model(out: Path, layers: int) -> None:
    from transformers import Mamba2Config, Mamba2ForCausalLM

    torch.manual_seed(0)
    cfg = Mamba2Config(vocab_size=1024, hidden_size=768, num_hidden_layers=layers, state_size=128, expand=2,
                       num_heads=24, head_dim=64, n_groups=1, chunk_size=256, conv_kernel=4,
                       tie_word_embeddings=True, layer_norm_epsilon=1e-5)
    Mamba2ForCausalLM(cfg).eval().save_pretrained(out)


def _mamba1(args) -> dict:
    from checkpoints import write_random_checkpoint
    from harness.recipes.quamba.w4.gptq_mamba1 import gptq_mamba1
    from harness.modes import CALIBRATION_RECIPES
    from harness.recipes.registry import resolve_modes
    from harness.runner.calibration import CalibrationSettings
    from harness.recipes.quamba.families import calibrate_key as calibrate

    with tempfile.TemporaryDirectory() as tmp:
        bank = WeightBank(open_checkpoint(write_random_checkpoint(Path(tmp), "mamba-130m")))
        depth = args.layers - 1
        gen = torch.Generator().manual_seed(1)
        windows = torch.randint(0, 50280, (args.calib_samples, args.calib_seqlen), generator=gen)
        model = build_backbone(CALIBRATION_RECIPES["quamba"], bank, None, depth, calibration=True)
        start = time.perf_counter()
        with torch.no_grad():
            for batch in windows.split(args.batch_size):
                model(batch)
        forward = time.perf_counter() - start
        params = [bank.layer(i, "fp16", True, "quamba") for i in range(depth + 1)]
        embed = lambda ids: bank.embed(ids, True, torch.float16, "quamba", "fp16")  # noqa: E731
        marks = [time.perf_counter()]
        gptq_mamba1(bank.dims, params, embed, windows, args.batch_size, False,
                    step=lambda: marks.append(time.perf_counter()))
        settings = CalibrationSettings(num_samples=args.calib_samples, seqlen=args.calib_seqlen,
                                       batch_size=args.batch_size)
        ids = torch.randint(0, 50280, (1, 512), generator=gen)
        modes = {}
        for name in ("0", "q2-w4a8", "q2-w4a16"):
            recipe = resolve_modes([name], architecture="mamba1")[0]
            scales = calibrate(bank, windows, settings, depth, [], None, recipe.calibration_key).scales
            m = build_backbone(recipe, bank, scales, depth)
            start = time.perf_counter()
            with torch.no_grad():
                m(ids)
            modes[name] = round(time.perf_counter() - start, 3)
    return {"shape": "mamba-130m blocks (Mamba-1)", "calibration_forward_s": round(forward, 3),
            "gptq_s": round(marks[-1] - marks[0], 3), "ratio_gptq_to_forward": round((marks[-1] - marks[0]) / forward, 2),
            "gptq_per_layer_s": [round(b - a, 3) for a, b in zip(marks, marks[1:])],
            "forward_512_tokens_s": modes}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--calib-samples", type=int, default=4)
    p.add_argument("--calib-seqlen", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--arch", choices=("mamba2", "mamba1"), default="mamba2")
    args = p.parse_args(argv)
    if args.arch == "mamba1":
        print(json.dumps({"layers": args.layers, "calibration_tokens": f"{args.calib_samples} x {args.calib_seqlen}",
                          **_mamba1(args), "threads": torch.get_num_threads()}))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        _model(Path(tmp), args.layers)
        bank = WeightBank(open_checkpoint(Path(tmp)))
        dims, depth = bank.dims, args.layers - 1
        windows = torch.randint(0, 1024, (args.calib_samples, args.calib_seqlen), generator=torch.Generator().manual_seed(1))
        embed = lambda ids: bank.embed(ids, True, torch.float16, "exact", "fp16")  # noqa: E731
        raws = [bank.raw(i) for i in range(depth + 1)]
        model = build_backbone(Q2_CALIBRATION_RECIPE, bank, None, depth)
        start = time.perf_counter()
        with torch.no_grad():
            for batch in windows.split(args.batch_size):
                model(batch)
        forward = time.perf_counter() - start
        marks = [time.perf_counter()]
        gptq_q2(dims, raws, embed, windows, args.batch_size, Q2_CALIBRATION_RECIPE, False,
                step=lambda: marks.append(time.perf_counter()))
        gptq = marks[-1] - marks[0]
    print(json.dumps({"shape": "mamba2-130m blocks", "layers": args.layers,
                      "calibration_tokens": f"{args.calib_samples} x {args.calib_seqlen}",
                      "calibration_forward_s": round(forward, 3), "gptq_s": round(gptq, 3),
                      "ratio_gptq_to_forward": round(gptq / forward, 2),
                      "gptq_per_layer_s": [round(b - a, 3) for a, b in zip(marks, marks[1:])],
                      "threads": torch.get_num_threads()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
