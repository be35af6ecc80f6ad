"""Estimate what Quamba2's Triton SSD (fp16 ``tl.dot`` operands, fp32 accumulation) changes against the
fp32 chunked SSD the harness runs for q2-w8a8 (docs/fidelity.md "Mamba-2 and Quamba2").

    .venv/bin/python benchmarks/fidelity_q2_ssd.py [--model models/mamba2-tiny] [--seq-len 256]

Runs q2-w8a8 on the model (calibration 8 x 128 tokens of the shipped text, not cached) and, for every
block's SSD, computes y twice from the same dequantized int8 inputs: with ops.ssd.ssd_chunked (fp32), and
with every matrix-product operand rounded to fp16 (C.B, the decayed scores, x*dt, the state, B*decay) as
the kernels feed ``tl.dot`` (quamba/triton/quant_chunk_state.py:235-248, quant_ssd_combined.py:146-162),
products summed in fp32. It prints the relative L2 distance of the two y per block, next to the distance
between q2-w8a8's y and fp32's y (the quantization error), so the sizes can be compared. The tile order of
the GPU's sums (autotuned) is not modelled. Nothing is written.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import harness.recipes.quamba.q2.block as q2_block  # noqa: E402
from harness.checkpoints.tokenizer import load_tokenizer
from harness.checkpoints.loading import open_checkpoint  # noqa: E402
from harness.checkpoints.text import DEFAULT_TEXT_FILE, tokenize_file  # noqa: E402
from harness.runner.backbone import build_backbone  # noqa: E402
from harness.emulation.capture import capture  # noqa: E402
from harness.kernels import portable  # noqa: E402
from harness.kernels.ssd import _heads, ssd_chunked  # noqa: E402
from harness.recipes.registry import get_mode  # noqa: E402
from harness.runner.calibration import CalibrationSettings
from harness.recipes.quamba.families import calibrate_key as calibrate  # noqa: E402
from harness.runner.weightbank import WeightBank  # noqa: E402


def h(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16).to(torch.float32)


def ssd_fp16_operands(x, dt, A_log, B, C, D, chunk_size):
    """ops.ssd.ssd_chunked's steps, with each einsum operand rounded to fp16 (fp32 sums)."""
    b, L, nh, p = x.shape
    A = -portable.exp(A_log.to(torch.float32).contiguous())
    Bh, Ch = h(_heads(B.float(), nh)), h(_heads(C.float(), nh))
    a, xdt = dt * A, h(x * dt[..., None])
    y = torch.empty(b, L, nh, p)
    state = torch.zeros(b, nh, p, B.shape[-1])
    for start in range(0, L, chunk_size):
        sl = slice(start, min(start + chunk_size, L))
        q = sl.stop - sl.start
        acs = torch.cumsum(a[:, sl], dim=1)
        diff = acs[:, :, None, :] - acs[:, None, :, :]
        causal = torch.ones(q, q, dtype=torch.bool).tril()[None, :, :, None]
        decay = portable.exp(torch.where(causal, diff, torch.full_like(diff, -torch.inf)).contiguous())
        scores = h(torch.einsum("blhn,bshn->blsh", Ch[:, sl], Bh[:, sl]) * decay)
        y_diag = torch.einsum("blsh,bshp->blhp", scores, xdt[:, sl])
        into = portable.exp(acs.contiguous())
        y_off = torch.einsum("blhn,bhpn->blhp", Ch[:, sl], h(state)) * into[..., None]
        y[:, sl] = y_diag + y_off
        to_end = portable.exp((acs[:, -1:, :] - acs).contiguous())
        state = state * into[:, -1, :, None, None] + \
            torch.einsum("bshn,bshp->bhpn", h(Bh[:, sl] * to_end[..., None]), xdt[:, sl])
    return y + D.to(torch.float32)[:, None] * x, state


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "mamba2-tiny")
    ap.add_argument("--seq-len", type=int, default=256)
    args = ap.parse_args()
    bank = WeightBank(open_checkpoint(args.model))
    ids = tokenize_file(load_tokenizer(args.model), DEFAULT_TEXT_FILE)
    windows, sample = ids[: 8 * 128].view(8, 128), ids[-args.seq_len:].view(1, -1)
    n = bank.dims.n_layer
    calib = calibrate(bank, windows, CalibrationSettings(8, 128), n - 1, [], None, "quamba2")
    gaps: list[float] = []

    def both(*a):
        y, state = ssd_chunked(*a)
        gaps.append(rel(ssd_fp16_operands(*a)[0], y))
        return y, state

    q2_block.ssd_chunked = both
    names = [f"L{i}.ssd.y" for i in range(n)]
    ys = {}
    for mode, scales in (("fp32", None), ("q2-w8a8", calib.scales)):
        bb = build_backbone(get_mode(mode), bank, scales, n - 1)
        with capture(bb, names) as cap:
            bb(sample)
        ys[mode] = {k: cap[k].values for k in names}
    for i, k in enumerate(names):
        print(f"layer {i}: y fp16 operands vs fp32 SSD rel L2 {gaps[i]:.3g}; "
              f"q2-w8a8 y vs fp32 mode rel L2 {rel(ys['q2-w8a8'][k], ys['fp32'][k]):.3g}")


if __name__ == "__main__":
    main()
