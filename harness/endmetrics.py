"""End-to-end metrics of next-token distributions: KL, top-1 agreement, cross-entropy, perplexity.

logits: (batch, seq, vocab) float; ids: (batch, seq) int64, the tokens the logits were computed on.
All sums in float64 over log_softmax of the logits (README "End to end"):

    KL(ref || mode)    mean over positions t of  sum_v p_ref(v|t) * (log p_ref(v|t) - log p_mode(v|t))
    top-1 agreement    fraction of positions t where argmax_v ref = argmax_v mode
    cross-entropy      mean over t = 0..seq-2 of  -log p(ids[t+1] | t)   (nats; the last position has no next token)
    perplexity         exp(cross-entropy)
"""
from __future__ import annotations

import math

import torch

__all__ = ["log_probs", "kl_divergence", "top1_agreement", "cross_entropy", "end_to_end_metrics"]


def log_probs(logits) -> torch.Tensor:
    return torch.log_softmax(torch.as_tensor(logits).to(torch.float64), dim=-1)


def kl_divergence(ref_logits, logits) -> float:
    lp_ref, lp = log_probs(ref_logits), log_probs(logits)
    return float((lp_ref.exp() * (lp_ref - lp)).sum(-1).mean())


def top1_agreement(ref_logits, logits) -> float:
    a, b = torch.as_tensor(ref_logits).argmax(-1), torch.as_tensor(logits).argmax(-1)
    return float((a == b).to(torch.float64).mean())


def cross_entropy(logits, ids) -> float:
    lp = log_probs(logits)[:, :-1]
    target = torch.as_tensor(ids)[:, 1:].unsqueeze(-1)
    if target.numel() == 0:
        return math.nan
    return float(-lp.gather(-1, target).mean())


def end_to_end_metrics(ref_logits, logits, ids) -> dict[str, float]:
    ce = cross_entropy(logits, ids)
    return {"kl": kl_divergence(ref_logits, logits), "top1_agreement": top1_agreement(ref_logits, logits),
            "cross_entropy": ce, "perplexity": math.exp(ce) if math.isfinite(ce) else math.nan}
