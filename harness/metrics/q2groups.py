"""Quamba2's x group diagnostics: SQNR and saturation of the grouped int8 x, per head group and per dim group.

Quamba2's conv quantizes x (the conv + SiLU output) with one scale per (SSD group g, head group hg, dim group
dg) cell (kernels.conv1d_grouped). For every cell, over every token of every sample, with v the fp32 value the
quantizer saw, q its int8 code and s_c the cell's scale (the same mode's own float x, before quantization, is
the reference: the error is the quantizer's alone, not the int8 in_proj's or the conv's upstream of it):

    signal = sum v^2,  noise = sum (v - f32(q * s_c))^2          in float64
    sqnr_db = 10 log10(signal / noise)                            inf when noise = 0, null when both are 0
    saturation = #(q == 127 or q == -128) / #values

Marginals add the sums of the cells first: ``head_groups`` [g][hg] over the dim groups, ``dim_groups`` [g][dg]
over the head groups (dim group k holds the k-th band of each head's channels sorted by magnitude, so it has
one meaning across head groups; head group labels have none across SSD groups), ``all`` over every cell.
Sums are additive: a layer's sums are those of its samples added in sample order.
"""
from __future__ import annotations

import math

import numpy as np

__all__ = ["XGroupSums", "channel_cells"]


def channel_cells(x_dim: int, ngroups: int, headdim: int, head_range: np.ndarray, dim_range: np.ndarray) -> np.ndarray:
    """The cell (g * H * D + hg * D + dg) of every reordered x channel, as the kernel finds it from the cumulative
    ranges (quamba2_conv1d_fwd_kernel.cuh:174-197); -1 for a channel outside every range."""
    n_hg, n_dg = dim_range.shape[1], dim_range.shape[2]
    group_size = x_dim // ngroups
    c = np.arange(x_dim)
    g, head, dim = c // group_size, (c % group_size) // headdim, c % headdim
    hg = (head[:, None] >= head_range[g]).sum(axis=1)                   # head groups whose end is <= the head
    hg_ok = hg < n_hg
    hg_c = np.minimum(hg, n_hg - 1)
    dg = (dim[:, None] >= dim_range[g, hg_c]).sum(axis=1)
    ok = hg_ok & (dg < n_dg)
    return np.where(ok, (g * n_hg + hg_c) * n_dg + np.minimum(dg, n_dg - 1), -1)


class XGroupSums:
    """The running sums of one block's x groups (module docstring); ``add`` one sample's x, ``stats`` the result."""

    def __init__(self, ngroups: int, headdim: int, head_range: np.ndarray, dim_range: np.ndarray,
                 channel_scales: np.ndarray, table: dict) -> None:
        self.shape = tuple(int(n) for n in np.asarray(dim_range).shape)      # (g, head groups, dim groups)
        self.scales = np.asarray(channel_scales, dtype=np.float32)
        self.cells = channel_cells(self.scales.size, ngroups, headdim, np.asarray(head_range), np.asarray(dim_range))
        self.table = table
        n = int(np.prod(self.shape))
        self.signal, self.noise = np.zeros(n), np.zeros(n)
        self.count, self.saturated = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)

    def add(self, values, codes) -> None:
        """values: (..., x_dim) fp32, codes: (..., x_dim) int8, reordered channels (torch tensors or arrays)."""
        v = np.asarray(values, dtype=np.float32).reshape(-1, self.scales.size)
        q = np.asarray(codes).reshape(-1, self.scales.size)
        err = v.astype(np.float64) - (q.astype(np.float32) * self.scales).astype(np.float64)
        inside = self.cells >= 0
        n = self.signal.size
        self.signal += np.bincount(self.cells[inside], (v.astype(np.float64) ** 2).sum(axis=0)[inside], n)
        self.noise += np.bincount(self.cells[inside], (err ** 2).sum(axis=0)[inside], n)
        self.count += np.bincount(self.cells[inside], minlength=n) * v.shape[0]
        sat = ((q == 127) | (q == -128)).sum(axis=0)
        self.saturated += np.bincount(self.cells[inside], sat[inside], n).astype(np.int64)

    def merge(self, other: "XGroupSums") -> None:
        """Add another sample's sums (the units of another process, in sample order)."""
        for name in ("signal", "noise", "count", "saturated"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def stats(self) -> dict:
        """The stats entry ``q2_groups`` (docs/analysis.md "Quamba2 x groups"): sqnr_db and saturation per cell
        and marginal, the value counts per cell and the scale table."""
        sums = [a.reshape(self.shape) for a in (self.signal, self.noise, self.count, self.saturated)]
        views = {"cells": lambda a: a, "head_groups": lambda a: a.sum(axis=2), "dim_groups": lambda a: a.sum(axis=1),
                 "all": lambda a: a.sum()}
        out: dict = {"sqnr_db": {}, "saturation": {}}
        for key, view in views.items():
            s, e, n, k = (view(a) for a in sums)
            out["sqnr_db"][key] = _tolist(np.vectorize(sqnr_db, otypes=[float])(s, e))
            out["saturation"][key] = _tolist(np.vectorize(_fraction, otypes=[float])(k, n))
        out["count"] = sums[2].tolist()
        out["scales"] = self.table
        return out


def sqnr_db(signal: float, noise: float) -> float:
    """10 log10(signal / noise); inf for no noise, NaN when there is neither signal nor noise."""
    if noise == 0:
        return math.nan if signal == 0 else math.inf
    return 10.0 * math.log10(signal / noise) if signal > 0 else -math.inf


def _fraction(k: int, n: int) -> float:
    return float(k) / float(n) if n else math.nan


def _tolist(a: np.ndarray):
    return a.tolist() if isinstance(a, np.ndarray) else float(a)
