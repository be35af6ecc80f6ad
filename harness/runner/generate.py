"""Free-running greedy generation of one mode (--generate N): where does its text leave the reference's?

Each mode runs the prefill over the prompt (the first --seq_len tokens of the sample), takes the argmax of
its logits at the last position as the first generated token, and feeds every generated token back through
its own recurrent step (``EmuBackbone.step``, docs/decode.md), N tokens in all. Stored:
``mode_{m}__generated_ids`` int64 [1, N]; per mode in the stats: the ids, the first step whose token differs
from the reference's, the agreement rate, and (added by the pipeline) the decoded text.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from .backbone import build_backbone
from ..emulation.state import BlockState
from .forwards import Forward, build_head
from .weightbank import WeightBank

__all__ = ["GENERATED", "greedy_ids", "greedy_run", "divergence"]

GENERATED = "generated_ids"  # the tensor name (capture.array_key: mode_{m}__generated_ids)


def greedy_ids(fwd: Forward, prompt: torch.Tensor, steps: int, bank: WeightBank,
               prefill: tuple[torch.Tensor, list[BlockState]] | None = None) -> np.ndarray:
    """N greedy tokens of fwd's mode after prompt (1, L): int64 (1, N). Ties go to the lowest id (torch.argmax).

    prefill: (the residual after the last block, every block's state) of the mode's prefill over prompt, handed
    over by the capture run (``forwards.run_mode(keep_states=True)`` of the whole model); None runs it here."""
    return greedy_run(fwd, prompt, steps, bank, prefill)[0]


def _nonfinite(logits: torch.Tensor, step: int) -> str | None:
    """A line naming the NaN/Inf in one step's logits (1, 1, vocab), None when all are finite."""
    nan, inf = int(torch.isnan(logits).sum()), int(torch.isinf(logits).sum())
    if not nan and not inf:
        return None
    return f"generation logits at step {step}: {nan} NaN and {inf} Inf of {logits.numel()} values"


@torch.no_grad()
def greedy_run(fwd: Forward, prompt: torch.Tensor, steps: int, bank: WeightBank,
               prefill: tuple[torch.Tensor, list[BlockState]] | None = None,
               step: Callable[[], None] | None = None) -> tuple[np.ndarray, list[str]]:
    """greedy_ids and the NaN policy's lines (``checks.record_nonfinite``): one per generation step whose
    logits hold NaN or Inf (the argmax of such logits is no token the mode chose: never a pass). step: called
    once per generated token (the progress line)."""
    model = build_backbone(fwd.recipe, bank, fwd.scales, bank.dims.n_layer - 1)
    head = build_head(fwd.recipe, bank, fwd.head_scale)
    if prefill is None or len(prefill[1]) != len(model.blocks):  # a capture of fewer blocks cannot hand over
        prefill = model.prefill(prompt)
    residual, states = prefill
    logits = head(residual[:, -1:])
    problems = [p for p in [_nonfinite(logits, 0)] if p]
    token = logits.argmax(-1)                                     # (1, 1)
    out = [token]
    tick = step if step is not None else (lambda: None)
    tick()
    for k in range(1, steps):
        residual, states = model.step(token, states)
        logits = head(residual)
        problems += [p for p in [_nonfinite(logits, k)] if p]
        token = logits.argmax(-1)
        out.append(token)
        tick()
    return torch.cat(out, dim=1).to(torch.int64).numpy(), problems


def divergence(ref_ids: np.ndarray, ids: np.ndarray) -> dict:
    """{"first_divergence": the first step whose token differs (None when none), "agreement": the fraction of
    steps with the reference's token}. ref_ids, ids: (1, N) int64."""
    same = np.asarray(ref_ids).reshape(-1) == np.asarray(ids).reshape(-1)
    first = np.flatnonzero(~same)
    return {"first_divergence": int(first[0]) if first.size else None, "agreement": float(same.mean())}
