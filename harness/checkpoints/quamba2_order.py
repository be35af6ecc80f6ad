"""The channel and head order of a Quamba2 checkpoint, recovered from the float model it was made from.

Quamba2 stores its weights already permuted by the calibrated head/dim grouping (reorder_mamba, enyac-group/Quamba
c474646 quamba/reorder_utils.py:173-199) and does not store the permutation. Checkpoint channel c is float channel
channel_index[c] (emulation.q2_params.reorder_raw): its in_proj z and x rows are the float rows, permuted. The
in_proj weight is quantized per split with the split's absmax (qLinearLayer.py:686-697), which a permutation does
not change, and the rotation acts on in_proj's columns, so the checkpoint's z|x codes of channel c equal the codes
the float model gets for channel channel_index[c] (emulation.weights_q2.q2_in_proj_weight on the un-permuted
model), and likewise the dt row of each head. Rows are matched exactly first; a row without an exact partner
(a checkpoint made on a GPU may differ by a code) takes the nearest unused float row (L1 distance of the codes).
"""
from __future__ import annotations

import torch

from ..emulation.weights_mamba2 import float_layer_mamba2
from ..emulation.weights_q2 import q2_in_proj_weight
from ..spec import Mamba2Dims

__all__ = ["match_rows", "recover_order"]


def match_rows(ours: torch.Tensor, theirs: torch.Tensor) -> tuple[torch.Tensor, int]:
    """index with theirs[index[r]] the row of `theirs` equal (else nearest) to ours[r], a permutation; and the
    number of rows matched exactly. ours, theirs: (n, k) integer codes."""
    n = ours.shape[0]
    by_bytes: dict[bytes, list[int]] = {}
    for r in range(n):
        by_bytes.setdefault(theirs[r].numpy().tobytes(), []).append(r)
    index = torch.full((n,), -1, dtype=torch.int64)
    used = torch.zeros(n, dtype=torch.bool)
    for r in range(n):
        cands = by_bytes.get(ours[r].numpy().tobytes())
        if cands:
            index[r] = cands.pop(0)
            used[index[r]] = True
    exact = int((index >= 0).sum())
    left = torch.nonzero(index < 0).flatten()
    if len(left):
        free = torch.nonzero(~used).flatten()
        dist = torch.cdist(ours[left].to(torch.float32), theirs[free].to(torch.float32), p=1)
        for j, r in enumerate(left.tolist()):  # greedy, in row order
            k = int(torch.argmin(dist[j]))
            index[r] = free[k]
            dist[:, k] = float("inf")
    return index, exact


def recover_order(ckpt_in_proj: torch.Tensor, raw: dict, dims: Mamba2Dims) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(channel_index, head_index, summary) of one block. ckpt_in_proj: the checkpoint's unpadded in_proj codes
    (n, d_model); raw: the float model's block tensors (checkpoints.loading.Checkpoint.raw_layer)."""
    E, bc, H = dims.d_inner, dims.ngroups * dims.d_state, dims.nheads
    p = float_layer_mamba2(raw, True, torch.float16)
    codes, _, _ = q2_in_proj_weight(p.in_proj, [E, E, bc, bc, H], [1.0] * 5)
    key = lambda c: torch.cat([c[:E], c[E:2 * E]], dim=1).to(torch.int16)  # noqa: E731  z | x row per channel
    channels, ch_exact = match_rows(key(ckpt_in_proj), key(codes))
    heads, h_exact = match_rows(ckpt_in_proj[-H:].to(torch.int16), codes[-H:].to(torch.int16))
    summary = {"channels_exact": round(ch_exact / E, 6), "heads_exact": round(h_exact / H, 6)}
    return channels, heads, summary
