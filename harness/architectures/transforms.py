"""Offline transforms of a block's weights that every block architecture shares (spec notes §2.1): the block's
RMSNorm weight folded into in_proj's columns, and the residual stream rotated with Had_D (kernels.hadamard).

A module directly under architectures/, beside the registry: the architecture folders import it, never each
other (tests/test_layering_graph.py).
"""
from __future__ import annotations

import torch

from ..kernels.hadamard import hadamard_transform

__all__ = ["rotated_projections"]


def rotated_projections(raw: dict[str, torch.Tensor | None], rotate: bool, rnd) -> tuple:
    """(in_proj, out_proj, norm_weight) of a float block, each rounded by `rnd` (to the recipe's dtype); with
    `rotate` the block's norm weight folds into in_proj's columns, in_proj takes Had_D^T and out_proj
    Had_D W Had_E^T, and the norm weight is gone. The same for Mamba-1 and Mamba-2 blocks."""
    in_proj, out_proj, norm_weight = rnd(raw["in_proj"]), rnd(raw["out_proj"]), rnd(raw["norm_weight"])
    if rotate:
        folded = rnd(raw["in_proj"].to(torch.float64) * raw["norm_weight"].to(torch.float64))
        in_proj = rnd(hadamard_transform(folded))                                  # W Had_D^T
        right = hadamard_transform(out_proj)                                      # W Had_E^T
        out_proj = rnd(hadamard_transform(right.t()).t())                         # Had_D (W Had_E^T)
        norm_weight = None
    return in_proj, out_proj, norm_weight
