"""The channel and head order of a Quamba2 checkpoint, recovered from the float model it was made from.

Quamba2 stores its weights already permuted by the calibrated head/dim grouping (reorder_mamba, enyac-group/Quamba
c474646 quamba/reorder_utils.py:173-199) and does not store the permutation. Checkpoint channel c is float channel
channel_index[c] (recipes.quamba.q2.params.reorder_raw): its in_proj z and x rows are the float rows, permuted. The
in_proj weight is quantized per split with the split's absmax (qLinearLayer.py:686-697), which a permutation does
not change, and the rotation acts on in_proj's columns, so the checkpoint's z|x codes of channel c equal the codes
the float model gets for channel channel_index[c] (emulation.weights_q2.q2_in_proj_weight on the un-permuted
model), and likewise the dt row of each head. Rows are matched exactly first; a row without an exact partner
(a checkpoint made on a GPU may differ by a code) takes the nearest unused float row (L1 distance of the codes).
"""
from __future__ import annotations

import torch

from ....architectures.mamba2.weights import float_layer_mamba2
from .weights import q2_in_proj_weight
from ....spec import Mamba2Dims

__all__ = ["match_rows", "recover_order", "match_nearest", "recover_order_w4", "MATCH_MIN"]

MATCH_MIN = 0.9  # cosine similarity of a W4 row and its float row (GPTQ int4 keeps far more)


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


def _unit(t: torch.Tensor) -> torch.Tensor:
    return t / t.norm(dim=1, keepdim=True).clamp_min(1e-30)


def match_nearest(ours: torch.Tensor, theirs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """index with theirs[index[r]] the row most similar (cosine) to ours[r], a permutation, and each pair's
    similarity. ours, theirs: (n, k) float rows. Each row takes its best; where two want the same, the rows
    choose greedily, the most similar first."""
    sim = _unit(ours.to(torch.float64)) @ _unit(theirs.to(torch.float64)).t()
    best, index = sim.max(dim=1)
    if torch.unique(index).numel() == index.numel():
        return index, best
    used = torch.zeros(sim.shape[1], dtype=torch.bool)
    for r in torch.argsort(best, descending=True).tolist():  # the most similar rows choose first
        row = sim[r].masked_fill(used, -float("inf"))
        index[r] = int(torch.argmax(row))
        best[r], used[index[r]] = row[index[r]], True
    return index, best


def _dequant(w) -> torch.Tensor:
    """An Int4Weight's real values up to a per-row factor: (code - 8) x group scale."""
    groups = w.group_scales.to(torch.float32).repeat_interleave(w.group_size, dim=1)
    return (w.codes.to(torch.float32) - 8) * groups


def recover_order_w4(in_proj, recipe: str, tensors: dict, raw: dict,
                     dims: Mamba2Dims) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(channel_index, head_index, summary) of one W4 block (recipes.quamba.w4.checkpoint_mamba2). W4A8: the
    GPTQ int4 rows of in_proj are not the float rows quantized on a grid we can reproduce, so each checkpoint
    channel takes the float channel whose folded, rotated fp16 z and x rows (the rows GPTQ quantized,
    recipes.quamba.w4.calibrate_mamba2) are the most similar (cosine, z and x each normalised: their channel scales differ), each
    head the most similar dt row; the summary gives the fraction matched with similarity >= MATCH_MIN. W4A16 is
    not reordered (modelutils_mamba.py:820-825): the identity, and the fraction of channels whose
    fp16 conv1d row and of heads whose fp16 dt_bias equal the float model's."""
    E, H = dims.d_inner, dims.nheads
    p = float_layer_mamba2(raw, True, torch.float16)
    if recipe == "W4A16":
        conv = tensors["conv1d.weight"][:E, 0].to(torch.float32)
        ch = (conv == p.conv_weight[:E]).all(dim=1).to(torch.float64).mean().item()
        hd = (tensors["dt_bias"].to(torch.float32) == p.dt_bias).to(torch.float64).mean().item()
        return torch.arange(E), torch.arange(H), {"channels_exact": round(ch, 6), "heads_exact": round(hd, 6)}
    w = _dequant(in_proj)
    key = lambda t: torch.cat([_unit(t[:E]), _unit(t[E:2 * E])], dim=1)  # noqa: E731
    channels, c_sim = match_nearest(key(w), key(p.in_proj))
    heads, h_sim = match_nearest(w[-H:], p.in_proj[-H:])
    summary = {"channels_matched": round(float((c_sim >= MATCH_MIN).to(torch.float64).mean()), 6),
               "heads_matched": round(float((h_sim >= MATCH_MIN).to(torch.float64).mean()), 6)}
    return channels, heads, summary
