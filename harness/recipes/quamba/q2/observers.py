"""Quamba2's min-max observer of the SSD input x across head groups (enyac-group/Quamba c474646
quamba/observer.py:173-258, ``CrossHeadMinmaxObserver`` with sym=True, clip_ratio 1).

For each (SSD group, head group, dim group) block of the reordered x (emulation.grouping_q2), the running
max over calibration batches of max(|x| over the block, 1e-5) (:213-229); the scale is that max / 127,
in fp32, at least 1e-6 (``_get_minmax_quantization_params``, :16-31). The result is the conv's and the
chunk scan's ``x_out_scales`` / ``x_scales`` table (ngroups, n_head_groups, n_dim_groups).
"""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["CrossHeadMinmaxObserver", "CachedStatesObserver"]


def _group_table(head_groups: list, dim_groups: list, cell: Callable[[int, slice, slice], torch.Tensor],
                 tail: tuple[int, ...] = ()) -> torch.Tensor:
    """(ngroups, n_head_groups, n_dim_groups, *tail) fp32: per (SSD group, head group, dim group) cell,
    max(cell(g, heads, dims), 1e-5): the cross-head min-max's abs max of one cell, floored as Quamba's observers do."""
    table = torch.empty(len(head_groups), len(head_groups[0]), len(dim_groups[0][0]), *tail, dtype=torch.float32)
    for g, sizes in enumerate(head_groups):
        h_start = 0
        for hg, h_size in enumerate(sizes):
            d_start = 0
            for dg, d_size in enumerate(dim_groups[g][hg]):
                table[g, hg, dg] = cell(g, slice(h_start, h_start + h_size), slice(d_start, d_start + d_size)).clamp(min=1e-5)
                d_start += d_size
            h_start += h_size
    return table


class CrossHeadMinmaxObserver:
    """head_groups: (ngroups, n_head_groups) sizes; dim_groups: (ngroups, n_head_groups, n_dim_groups) sizes
    (grouping_q2.GroupReorder); each head group's dim sizes add up to headdim."""

    def __init__(self, ngroups: int, headdim: int, head_groups: torch.Tensor, dim_groups: torch.Tensor) -> None:
        if head_groups.shape[0] != ngroups or dim_groups.shape[:2] != head_groups.shape:
            raise ValueError(f"group tables {list(head_groups.shape)} and {list(dim_groups.shape)} do not fit "
                             f"ngroups={ngroups}")
        if not bool((dim_groups.sum(-1) == headdim).all()):
            raise ValueError(f"every head group's dim groups must add up to headdim={headdim}")
        self.ngroups, self.headdim = ngroups, headdim
        self.head_groups, self.dim_groups = head_groups.tolist(), dim_groups.tolist()
        self.amax: torch.Tensor | None = None  # (ngroups, n_head_groups, n_dim_groups) fp32

    def update(self, x: torch.Tensor) -> None:
        """x: (batch, seqlen, ngroups * nheads * headdim), reordered as the weights are."""
        b, L, d = x.shape
        w = x.to(torch.float32).reshape(b, L, self.ngroups, -1, self.headdim)
        table = _group_table(self.head_groups, self.dim_groups, lambda g, h, d: w[:, :, g, h, d].abs().amax())
        self.amax = table if self.amax is None else torch.maximum(self.amax, table)

    def scales(self) -> torch.Tensor:
        """(ngroups, n_head_groups, n_dim_groups) fp32: amax / 127, at least 1e-6."""
        if self.amax is None:
            raise ValueError("the observer has seen no data (call update first)")
        return (self.amax / 127).to(torch.float32).clamp(min=1e-6)


class CachedStatesObserver:
    """quamba/observer.py:288-384 (``CachedStatesCrossHeadMinmaxObserver``, sym=True, clip_ratio 1): the SSM state
    the prefill leaves in the calibration model's cache, (batch, nheads, headdim, d_state) in the reordered head and
    channel order, fp16 (Mamba2Simple.allocate_inference_cache keeps the fp16 model's dtype, quamba/qMamba2.py:346;
    observed as fp32, :324). Per (SSD group, head group, dim group) and state index n: the running max over batches
    of max(|state| over the batch, the group's heads and dims, 1e-5) (:326-340); the scale is that max / 127 in
    fp32, at least 1e-6 (:16-31). The result is ``ssm_state_scale`` (ngroups, n_head_groups, n_dim_groups, d_state)
    (Quamba2ChunkScan.get_ssm_state_scales, quamba/qChunkScan.py:137-150)."""

    def __init__(self, ngroups: int, headdim: int, head_groups: torch.Tensor, dim_groups: torch.Tensor) -> None:
        self.ngroups, self.headdim = ngroups, headdim
        self.head_groups, self.dim_groups = head_groups.tolist(), dim_groups.tolist()
        self.amax: torch.Tensor | None = None

    def update(self, state: torch.Tensor) -> None:
        """state: (batch, nheads, headdim, d_state), the fp16-rounded cached state."""
        b, nheads, hd, n = state.shape
        w = state.to(torch.float32).reshape(b, self.ngroups, nheads // self.ngroups, hd, n)
        table = _group_table(self.head_groups, self.dim_groups, lambda g, h, d: w[:, g, h, d].abs().amax(dim=(0, 1, 2)),
                             (n,))
        self.amax = table if self.amax is None else torch.maximum(self.amax, table)

    def scales(self) -> torch.Tensor:
        """(ngroups, n_head_groups, n_dim_groups, d_state) fp32: amax / 127, at least 1e-6."""
        if self.amax is None:
            raise ValueError("the observer has seen no data (call update first)")
        return (self.amax / 127).to(torch.float32).clamp(min=1e-6)
