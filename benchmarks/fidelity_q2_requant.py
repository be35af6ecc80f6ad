"""What the ``·1e6`` of Quamba2's state re-quantization changes on a CPU, in fp32 (docs/decode.md "What the CPU
does not reproduce of the GPU step").

    .venv/bin/python benchmarks/fidelity_q2_requant.py [--n 10000000] [--seed 0]

Quamba2's Triton step re-quantizes the state as ``rint((h * 1e6) / (s * 1e6))`` (enyac-group/Quamba c474646
quamba/triton/selective_state_update.py:355; the same at quant_ssm_states.py:113), harness.kernels.ssd_step.
requantize_q2_state. This counts the int8 codes where that form and a plain ``rint(h / s)`` differ, both in IEEE
fp32 (the GPU's ``div.full.f32`` is not reproduced): over random states (|h / s| ~ N(0, 60), s uniform in
[1e-4, 0.05]) and over states half a code off the grid (h = f32((k + 1/2) s), the ties). Nothing is written.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.kernels.ssd_step import requantize_q2_state  # noqa: E402


def _plain(h: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return torch.round(h / s).clamp(-128, 127).to(torch.int8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10_000_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    s = torch.rand(args.n, generator=gen) * 0.05 + 1e-4
    h = torch.randn(args.n, generator=gen) * 60 * s
    random = int((requantize_q2_state(h, s) != _plain(h, s)).sum())
    k = torch.randint(-120, 120, (args.n,), generator=gen).to(torch.float32)
    ties = (k + 0.5) * s
    tied = int((requantize_q2_state(ties, s) != _plain(ties, s)).sum())
    print(f"random states: {random} of {args.n} codes differ ({random / args.n:.2e})")
    print(f"half-code ties: {tied} of {args.n} codes differ ({tied / args.n:.1%})")


if __name__ == "__main__":
    main()
