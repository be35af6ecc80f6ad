"""How much GPTQ's float32 arithmetic moves its codes: float32 (Quamba's dtype) vs float64, same Hessians
(docs/fidelity.md "Mamba-2 and Quamba2").

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/fidelity_gptq.py [--model models/mamba2-tiny]

Per block of the model (inputs: the float fp16 calibration model's, 16 x 128 seeded random tokens), the
Hessians of in_proj and out_proj (float32, as Quamba), then GPTQ twice: float32 and float64 (emulation.gptq,
``dtype``). Prints per linear how many codes differ and by how much at most, and the share over the model.
Quamba's GPU runs the float32 algorithm with cuBLAS's summation order, the CPU with its BLAS's: this measures
how sensitive the codes are to rounding of that size, not the GPU's own result. Nothing is written.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.checkpoints.loading import open_checkpoint  # noqa: E402
from harness.architectures.mamba2.build import build_mamba2_block  # noqa: E402
from harness.emulation.gptq import gptq_group_size, gptq_int4, to_int4_weight  # noqa: E402
from harness.recipes.quamba.w4.gptq_mamba2 import block_hessians  # noqa: E402
from harness.architectures.mamba2.weights import float_layer_mamba2  # noqa: E402
from harness.modes import Q2_CALIBRATION_RECIPE  # noqa: E402
from harness.runner.weightbank import WeightBank  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "models" / "mamba2-tiny"))
    args = p.parse_args(argv)
    bank = WeightBank(open_checkpoint(Path(args.model)))
    d = bank.dims
    windows = torch.randint(0, d.vocab_size, (16, 128), generator=torch.Generator().manual_seed(0))
    res = [bank.embed(b, True, torch.float16, "exact", "fp16") for b in windows.split(8)]
    rows, total, differ = [], 0, 0
    for i in range(d.n_layer):
        w = float_layer_mamba2(bank.raw(i), True, torch.float16)
        block = build_mamba2_block(Q2_CALIBRATION_RECIPE, w, d, i)
        h_in, h_out = block_hessians(block, res, d)
        for name, weight, h, g in (("in_proj", w.in_proj, h_in.H, gptq_group_size(d.d_model)),
                                   ("out_proj", w.out_proj, h_out.H, gptq_group_size(d.d_inner))):
            a = to_int4_weight(*gptq_int4(weight, h, g), False).codes.to(torch.int32)
            b = to_int4_weight(*gptq_int4(weight, h.to(torch.float64), g, dtype=torch.float64), False).codes.to(torch.int32)
            n = int((a != b).sum())
            total, differ = total + a.numel(), differ + n
            rows.append({"layer": i, "linear": name, "codes": a.numel(), "differ": n, "max_step": int((a - b).abs().max())})
        with torch.no_grad():
            res = [block(r)[1] for r in res]
    print(json.dumps({"model": Path(args.model).name, "linears": rows, "share_differ": round(differ / total, 5)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
