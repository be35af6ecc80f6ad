"""End-to-end metrics of next-token distributions: KL, top-1 agreement, cross-entropy, perplexity.

logits: (batch, seq, vocab) float; ids: (batch, seq) int64, the tokens the logits were computed on.
All sums in float64 over log_softmax of the logits, 64 positions at a time (README "Metric formulas"):

    KL(ref || mode)    mean over positions t of  sum_v p_ref(v|t) * (log p_ref(v|t) - log p_mode(v|t))
    top-1 agreement    fraction of positions t where argmax_v ref = argmax_v mode
    cross-entropy      mean over t = 0..seq-2 of  -log p(ids[t+1] | t)   (nats; the last position has no next token)
    perplexity         exp(cross-entropy)
    over several windows: exp(sum_k n_k * cross-entropy_k / sum_k n_k), n_k the window's predicted tokens
    (the mean NLL over every predicted token of every window: the perplexity papers report)
"""
from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["log_probs", "kl_divergence", "top1_agreement", "cross_entropy", "end_to_end_metrics", "pooled_perplexity"]


_CHUNK = 64  # positions per float64 log_softmax: [64, vocab] buffers instead of [seq, vocab]


def _fixed_sum(x: torch.Tensor) -> float:
    """The sum of a (rows, n) float64 tensor in one fixed order whatever torch's thread count: numpy's pairwise
    sum of each row, then of the row sums (torch's full-tensor sum splits its work by thread count, so a
    worker with one thread and a driver with several disagreed in the last bit)."""
    return float(np.sum(np.sum(x.detach().cpu().numpy(), axis=-1)))


def log_probs(logits) -> torch.Tensor:
    return torch.log_softmax(torch.as_tensor(logits).to(torch.float64), dim=-1)


def _positions(x) -> torch.Tensor:
    """(..., vocab) -> (positions, vocab), a view where possible."""
    x = torch.as_tensor(x)
    return x.reshape(-1, x.shape[-1])


def kl_divergence(ref_logits, logits) -> float:
    ref, mode = _positions(ref_logits), _positions(logits)
    total = 0.0
    for start in range(0, ref.shape[0], _CHUNK):
        lp_ref, lp = log_probs(ref[start:start + _CHUNK]), log_probs(mode[start:start + _CHUNK])
        total += _fixed_sum(lp_ref.exp() * (lp_ref - lp))
    return total / ref.shape[0]


def top1_agreement(ref_logits, logits) -> float:
    a, b = torch.as_tensor(ref_logits).argmax(-1), torch.as_tensor(logits).argmax(-1)
    return float((a == b).to(torch.float64).mean())


def cross_entropy(logits, ids) -> float:
    x = torch.as_tensor(logits)[:, :-1]
    target = torch.as_tensor(ids)[:, 1:].reshape(-1)
    if target.numel() == 0:
        return math.nan
    rows = x.reshape(-1, x.shape[-1])
    total = 0.0
    for start in range(0, rows.shape[0], _CHUNK):
        lp = log_probs(rows[start:start + _CHUNK])
        total -= _fixed_sum(lp.gather(-1, target[start:start + _CHUNK, None]))
    return total / target.numel()


def end_to_end_metrics(ref_logits, logits, ids) -> dict[str, float]:
    ref, mode = torch.as_tensor(ref_logits), torch.as_tensor(logits)
    if mode.dim() == 3 and mode.shape[0] == 1 and ref.shape == mode.shape:
        kl, ce = _kl_and_ce(ref, mode, torch.as_tensor(ids))
    else:
        kl, ce = kl_divergence(ref, mode), cross_entropy(mode, ids)
    return {"kl": kl, "top1_agreement": top1_agreement(ref, mode),
            "cross_entropy": ce, "perplexity": math.exp(ce) if math.isfinite(ce) else math.nan}


def _kl_and_ce(ref: torch.Tensor, mode: torch.Tensor, ids: torch.Tensor) -> tuple[float, float]:
    """kl_divergence and cross_entropy of one window (batch 1), each chunk's log_softmax computed once: the mode's
    serves both (the two walk the same chunks of positions), and the reference's is the mode's when they are one
    array (the reference against itself). log_softmax is per row, so a row's values do not depend on the chunk's
    other rows; the sums are the two functions' own, in their order."""
    ref, mode = _positions(ref), _positions(mode)
    target = ids[:, 1:].reshape(-1)
    positions = ref.shape[0]
    one = ref.data_ptr() == mode.data_ptr() and ref.stride() == mode.stride()
    kl = ce = 0.0
    for start in range(0, positions, _CHUNK):
        lp = log_probs(mode[start:start + _CHUNK])
        lp_ref = lp if one else log_probs(ref[start:start + _CHUNK])
        kl += _fixed_sum(lp_ref.exp() * (lp_ref - lp))
        rows = min(_CHUNK, target.numel() - start)  # cross_entropy's chunk: positions with a next token
        if rows > 0:
            ce -= _fixed_sum(lp[:rows].gather(-1, target[start:start + rows, None]))
    return kl / positions, (ce / target.numel() if target.numel() else math.nan)


def pooled_perplexity(cross_entropies: list[float], predicted: list[int]) -> float:
    """exp of the mean NLL over every predicted token of every window: cross-entropies weighted by the
    number of tokens each window predicts (not the mean of the windows' perplexities)."""
    total = sum(predicted)
    if total == 0:
        return math.nan
    ce = sum(c * n for c, n in zip(cross_entropies, predicted)) / total
    return math.exp(ce) if math.isfinite(ce) else math.nan
