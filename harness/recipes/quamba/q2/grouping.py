"""Quamba2's head and dim grouping of the SSD input x (enyac-group/Quamba c474646 quamba/reorder_utils.py:85-134).

From each x channel's calibrated max (``x_conv_out``, :151), per SSD group:

1. sort the channels of every head by their max, ascending (:90-92), and normalise each head's sorted
   vector to unit L2 norm (:95-96);
2. cluster the heads into ``nhead_groups`` with scikit-learn's AgglomerativeClustering (euclidean, ward)
   on those vectors, and order the heads by cluster label (np.argsort of the labels, numpy's default
   sort as in Quamba, :104-107);
3. within each head group, cluster the sorted channel positions into ``ndim_groups`` with KMeans on the
   transposed vectors, initialised with every (headdim / ndim_groups)-th position, so its labels rise
   monotonically (:116-125).

The results (channel order, head order, the head groups' and dim groups' sizes) reorder the weights and
give the kernels' cumulative ranges (quamba/qMamba2.py:57-59: cumsum). scikit-learn is imported only
here, when grouping is asked for (pinned in pyproject's quamba2 extra).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["GroupReorder", "check_grouping_input", "group_wise_sort_indices", "group_ranges"]


@dataclass(frozen=True)
class GroupReorder:
    """channel_index: (ngroups*nheads*headdim,) the channel order; head_index: (ngroups*nheads,) the head order;
    head_groups: (ngroups, nhead_groups) int32 sizes; dim_groups: (ngroups, nhead_groups, ndim_groups) int32 sizes."""

    channel_index: torch.Tensor
    head_index: torch.Tensor
    head_groups: torch.Tensor
    dim_groups: torch.Tensor


def _run_starts(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Start and end of each run of equal values in sorted labels (np.unique's first indices)."""
    _, starts = np.unique(labels, return_index=True)
    return starts, np.append(starts[1:], len(labels))


def check_grouping_input(channel_max: torch.Tensor, headdim: int, ngroups: int) -> None:
    """The clustering's input: finite statistics, and no head whose vector is all zeros (it is normalised to
    unit norm); a ValueError naming the first channel or head otherwise (scikit-learn's own is about imputers)."""
    bad = ~torch.isfinite(channel_max)
    if bad.any():
        first = int(bad.nonzero()[0])
        raise ValueError(f"the x channel statistics (conv1d.x, the head/dim clustering's input) hold {int(bad.sum())} "
                         f"non-finite value(s), first channel {first} = {float(channel_max[first])}; they must be finite")
    norms = channel_max.reshape(ngroups, -1, headdim).norm(dim=-1)
    if (norms == 0).any():
        g, h = (int(v) for v in (norms == 0).nonzero()[0])
        raise ValueError(f"the x channel statistics (conv1d.x) of head {h} of SSD group {g} are all zero; the head/dim "
                         f"clustering normalises each head's statistics, so every head needs a nonzero one")


def group_wise_sort_indices(channel_max: torch.Tensor, headdim: int, ngroups: int, nhead_groups: int = 4,
                            ndim_groups: int = 4) -> GroupReorder:
    """channel_max: (ngroups * nheads * headdim,) per-channel statistics of x (module docstring)."""
    from sklearn.cluster import AgglomerativeClustering, KMeans

    check_grouping_input(channel_max, headdim, ngroups)
    per_head = channel_max.reshape(ngroups, -1, headdim)
    nheads = per_head.shape[1]
    dim_order = torch.argsort(per_head, dim=-1)
    channels = torch.arange(channel_max.numel()).reshape(ngroups, nheads, headdim).gather(-1, dim_order)
    sorted_vals = per_head.gather(-1, dim_order)
    normed = (sorted_vals / sorted_vals.norm(dim=-1, keepdim=True)).cpu().numpy()
    heads = torch.arange(ngroups * nheads).reshape(ngroups, nheads)
    head_sizes, dim_sizes = [], []
    for g in range(ngroups):
        labels = AgglomerativeClustering(n_clusters=nhead_groups, metric="euclidean", linkage="ward").fit(normed[g]).labels_
        order = torch.from_numpy(np.argsort(labels))
        heads[g], channels[g] = heads[g, order], channels[g, order]
        starts, ends = _run_starts(np.sort(labels))
        head_sizes.append(list(ends - starts))
        sizes_g = []
        for start, end in zip(starts, ends):
            points = normed[g][start:end, :].transpose()
            km = KMeans(n_clusters=ndim_groups, init=points[0::headdim // ndim_groups, :]).fit(points)
            if not np.all(np.diff(km.labels_) >= 0):
                raise ValueError("dim clustering labels are not monotonic (Quamba asserts the same, :122)")
            d_starts, d_ends = _run_starts(km.labels_)
            sizes_g.append(list(d_ends - d_starts))
        dim_sizes.append(sizes_g)
    return GroupReorder(channels.flatten(), heads.flatten(), torch.tensor(head_sizes, dtype=torch.int32),
                        torch.tensor(dim_sizes, dtype=torch.int32))


def group_ranges(r: GroupReorder) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' cumulative ends: x_head_group_range (ngroups, nhead_groups) and x_dim_group_range
    (ngroups, nhead_groups, ndim_groups), int32 (quamba/qMamba2.py:57-59)."""
    return torch.cumsum(r.head_groups, dim=1).to(torch.int32), torch.cumsum(r.dim_groups, dim=2).to(torch.int32)
