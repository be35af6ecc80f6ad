"""How long a calibration will take, said before it starts: tokens x layers x d_inner x a measured cost.

The calibration forward's time per token and layer grows with the block's inner width d_inner and
hardly with d_model (measured: a seeded d_model 768 / d_inner 1536 block took 3.97x the time per
token of the shipped model's 192 / 384, 16 windows of 128 tokens, one torch thread). The cost per
token, layer and inner channel is the shipped model's default calibration (512 windows of 512 tokens,
layer 0, batch 8) on the 2-core development machine with one torch thread, shared with other jobs:
52.7 s / (262,144 tokens x 384 channels). An idle machine, or more threads, is faster; the progress
line corrects the estimate from the measured rate once the first batches are done.

Mamba-2's calibration (Quamba2) runs the windows through the blocks twice (a pass for the observers of the
inputs, one for the outputs), each pass a forward of its d_inner = nheads x headdim channels: its estimate is
the same cost per token, layer and inner channel, times the two passes.

A recipe whose calibration costs another multiple of a forward says so with `passes` (GPTQ's phase of Quamba2's W4
recipes: recipes.quamba.w4.calibrate_mamba2.GPTQ_PASSES).
"""
from __future__ import annotations

__all__ = ["SECONDS_PER_TOKEN_CHANNEL", "estimate_seconds"]

SECONDS_PER_TOKEN_CHANNEL = 52.7 / (512 * 512 * 384)  # about 5.2e-7 s per token, layer and inner channel


def estimate_seconds(tokens: int, layers: int, dims, passes: float = 1) -> float:
    """Seconds a calibration of `tokens` tokens through `layers` blocks of `dims` (its d_inner) should take,
    `passes` times over (Mamba-2's Quamba2 calibration: 2)."""
    return tokens * layers * dims.d_inner * passes * SECONDS_PER_TOKEN_CHANNEL
