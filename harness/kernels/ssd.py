"""Mamba-2's SSD (state space duality) scan and its gated, group-wise RMSNorm, in floating point.

Per head h (headdim p, state n, the head's SSD group g = h // (nheads / ngroups)):

    dt_t = softplus(dt_raw_t + dt_bias_h)                      (dt_limit (0, inf): no clamp)
    a_t  = dt_t * A_h,   A_h = -exp(A_log_h)
    H_t  = exp(a_t) H_{t-1} + dt_t x_t B_t^T                   H: (p, n), H_0 = 0
    y_t  = H_t C_t + D_h x_t

(transformers 5.23 models/mamba2/modeling_mamba2.py:257-370 ``mamba2_chunk_scan``, the torch path
of ``Mamba2Mixer.forward``, :572-598; mamba_ssm's ``ssd_chunk_scan_combined`` computes the same.)

``ssd_chunked`` computes it by chunks of ``chunk_size`` tokens as the kernels and transformers do: within
a chunk the output is a masked (C B^T * decay) product applied to dt x, across chunks the chunk-end
states are carried by a recurrence; ``ssd_ref`` runs the recurrence token by token (the oracle and the
``ssm_impl=reference`` arithmetic). Both compute in fp32 with kernels.portable's exp and softplus; the chunked
form's products are correctly rounded (kernels.exactdot.matmul_rn) and its running sums in a fixed order
(cumsum_tokens), so the same inputs give the same bits on every CPU and GPU.
"""
from __future__ import annotations

import torch

from . import portable
from .exactdot import matmul_rn

__all__ = ["ssd_dt", "cumsum_tokens", "ssd_chunked", "ssd_ref", "gated_rmsnorm", "gated_rmsnorm_ref"]


def ssd_dt(dt_raw: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
    """softplus(dt_raw + dt_bias) in fp32: (batch, seqlen, nheads)."""
    return portable.softplus((dt_raw.to(torch.float32) + dt_bias.to(torch.float32)).contiguous())


def _heads(t: torch.Tensor, nheads: int) -> torch.Tensor:
    """(batch, seqlen, ngroups, n) -> (batch, seqlen, nheads, n): each head takes its group's B or C."""
    return t.repeat_interleave(nheads // t.shape[2], dim=2)


def _causal_decay(acs: torch.Tensor) -> torch.Tensor:
    """(b, q, h) cumulative sums of a chunk -> (b, l, s, h): the decay from s to l, exp(acs_l - acs_s) for s <= l,
    +0.0 above the diagonal (what exp(-inf) gives). The exp runs on the q (q + 1) / 2 entries on and below the
    diagonal only; each is the same subtraction and the same portable.exp as over the whole square."""
    b, q, h = acs.shape
    rows, cols = torch.tril_indices(q, q)
    decay = torch.zeros(b, q, q, h, dtype=torch.float32)
    decay[:, rows, cols] = portable.exp_((acs[:, rows] - acs[:, cols]).contiguous())
    return decay


def _causal_decay_square(acs: torch.Tensor) -> torch.Tensor:
    """_causal_decay over the whole square (the masked entries as exp(-inf)): the oracle of its bits."""
    q = acs.shape[1]
    diff = acs[:, :, None, :] - acs[:, None, :, :]
    causal = torch.ones(q, q, dtype=torch.bool).tril()[None, :, :, None]
    return portable.exp(torch.where(causal, diff, torch.full_like(diff, -torch.inf)).contiguous())


def cumsum_tokens(a: torch.Tensor) -> torch.Tensor:
    """Running sums over dim 1 in a fixed order: float64 partial sums, token after token, each rounded to fp32 (as
    ATen's CPU cumsum of fp32 computes; CUDA's parallel scan takes another order)."""
    out = torch.empty_like(a)
    acc = torch.zeros_like(a[:, 0], dtype=torch.float64)
    for t in range(a.shape[1]):
        acc += a[:, t]
        out[:, t] = acc
    return out


def ssd_chunked(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                D: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked SSD.

    x: (batch, seqlen, nheads, headdim); dt: (batch, seqlen, nheads) after softplus (ssd_dt);
    A_log, D: (nheads,); B, C: (batch, seqlen, ngroups, d_state). All fp32 values.
    Returns y (batch, seqlen, nheads, headdim) with the D skip, and the final state
    (batch, nheads, headdim, d_state), both fp32.
    """
    b, L, h, p = x.shape
    n = B.shape[-1]
    A = -portable.exp(A_log.to(torch.float32).contiguous())
    Bh, Ch = _heads(B.float(), h), _heads(C.float(), h)
    a = dt * A                                               # (b, L, h)
    xdt = x * dt[..., None]                                   # (b, L, h, p)
    y = torch.empty(b, L, h, p, dtype=torch.float32)
    state = torch.zeros(b, h, p, n, dtype=torch.float32)
    for start in range(0, L, chunk_size):
        sl = slice(start, min(start + chunk_size, L))
        acs = cumsum_tokens(a[:, sl])                       # (b, q, h): sum of a over the chunk up to l
        decay = _causal_decay(acs)                             # (b, l, s, h)
        ch = Ch[:, sl].permute(0, 2, 1, 3)                     # (b, h, l, n)
        xh = xdt[:, sl].permute(0, 2, 1, 3)                    # (b, h, s, p)
        # C_l . B_s is the same for every head of an SSD group: one product per group, then per head
        cb = matmul_rn(C[:, sl].float().permute(0, 2, 1, 3), B[:, sl].float().permute(0, 2, 3, 1))  # (b, g, l, s)
        scores = cb.repeat_interleave(h // B.shape[2], dim=1) * decay.permute(0, 3, 1, 2)          # (b, h, l, s)
        y_diag = matmul_rn(scores, xh)                         # (b, h, l, p)
        # the state entering the chunk, seen at l: exp(acs_l) C_l . H
        into = portable.exp(acs.contiguous())                 # (b, q, h)
        y_off = matmul_rn(ch, state.transpose(-1, -2)) * into.transpose(1, 2)[..., None]
        y[:, sl] = (y_diag + y_off).transpose(1, 2)
        # the state at the chunk's end: exp(acs_end) H + sum_s exp(acs_end - acs_s) dt_s x_s B_s^T
        to_end = portable.exp((acs[:, -1:, :] - acs).contiguous())  # (b, q, h)
        state = state * into[:, -1, :, None, None] + \
            matmul_rn(xh.transpose(-1, -2), (Bh[:, sl] * to_end[..., None]).permute(0, 2, 1, 3))
    return y + D.to(torch.float32)[:, None] * x, state


def ssd_ref(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
            D: torch.Tensor, h0: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD recurrence token by token in fp32 (shapes as ssd_chunked; no chunks), from the state h0
    (batch, nheads, headdim, d_state; None: zeros). Over one token from the carried state this is the decode
    step: transformers 5.23 ``mamba2_selective_state_update`` (modeling_mamba2.py:195-254: dA = exp(dt A),
    state = state dA + dt B x, y = state C + D x; z is applied by the gated norm, :561 passes z=None)."""
    b, L, h, p = x.shape
    A = -portable.exp(A_log.to(torch.float32).contiguous())
    Bh, Ch = _heads(B.float(), h), _heads(C.float(), h)
    decay = portable.exp((dt * A).contiguous())               # (b, L, h)
    n = Bh.shape[-1]
    state = torch.zeros(b, h, p, n, dtype=torch.float32) if h0 is None else h0.to(torch.float32, copy=True)
    y = torch.empty(b, L, h, p, dtype=torch.float32)
    # per token: state = state * decay + (x dt) B^T, y = sum_n state * C; each product and sum rounded as written,
    # computed into buffers of this call (no new (b, h, p, n) tensor per op: 30 % of the time at 130m's shape)
    xdt = x * dt[..., None]                                   # (b, L, h, p)
    upd, prod = torch.empty_like(state), torch.empty_like(state)
    for t in range(L):
        torch.mul(xdt[:, t, :, :, None], Bh[:, t, :, None, :], out=upd)
        state.mul_(decay[:, t, :, None, None]).add_(upd)
        torch.mul(state, Ch[:, t, :, None, :], out=prod)
        torch.sum(prod, -1, out=y[:, t])
    return y + D.to(torch.float32)[:, None] * x, state


def _ssd_ref_allocating(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                        D: torch.Tensor, h0: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ssd_ref as first written, a new tensor per op: the oracle of its bits (tests/architectures/mamba2/test_m2_speed.py)."""
    b, L, h, p = x.shape
    A = -portable.exp(A_log.to(torch.float32).contiguous())
    Bh, Ch = _heads(B.float(), h), _heads(C.float(), h)
    decay = portable.exp((dt * A).contiguous())
    state = torch.zeros(b, h, p, Bh.shape[-1], dtype=torch.float32) if h0 is None else h0.to(torch.float32)
    y = torch.empty(b, L, h, p, dtype=torch.float32)
    for t in range(L):
        upd = (x[:, t] * dt[:, t, :, None])[..., None] * Bh[:, t, :, None, :]
        state = state * decay[:, t, :, None, None] + upd
        y[:, t] = (state * Ch[:, t, :, None, :]).sum(-1)
    return y + D.to(torch.float32)[:, None] * x, state


def gated_rmsnorm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, ngroups: int, eps: float) -> torch.Tensor:
    """Mamba-2's gated RMSNorm (norm_before_gate=False), group-wise: g = y * silu(z); per group of
    d_inner / ngroups channels, g * 1/sqrt(mean(g^2) + eps); times weight. fp32 in, fp32 out.

    As transformers 5.23 ``MambaRMSNormGated.forward`` (modeling_mamba2.py:112-123, group_size =
    intermediate_size // n_groups at :430-432) and mamba_ssm's ``RMSNormGated(d_ssm, group_size=d_ssm //
    ngroups)``; the mean uses kernels.portable's fixed-order sum and correctly rounded sqrt (as EmuRMSNorm).
    y, z: (batch, seqlen, d_inner); weight: (d_inner,).
    """
    g = y.to(torch.float32) * portable.silu(z.to(torch.float32).contiguous())
    *lead, d = g.shape
    grouped = g.reshape(*lead, ngroups, d // ngroups)
    var = portable.mean_last(grouped * grouped)
    normed = (grouped * (1.0 / portable.sqrt(var + eps))).reshape(*lead, d)
    return normed * weight.to(torch.float32)


def gated_rmsnorm_ref(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, ngroups: int, eps: float) -> torch.Tensor:
    """Oracle of gated_rmsnorm in float64, one group at a time."""
    g = y.double() * z.double() * torch.sigmoid(z.double())
    size = g.shape[-1] // ngroups
    parts = [g[..., k * size:(k + 1) * size] for k in range(ngroups)]
    out = torch.cat([part / torch.sqrt(part.pow(2).mean(-1, keepdim=True) + eps) for part in parts], dim=-1)
    return out * weight.double()
