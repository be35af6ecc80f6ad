"""The rounding rules every quantizer names: ties to even (RNE), ties away from zero (C roundf)."""
from __future__ import annotations

import torch

from ..spec import Rounding

__all__ = ["round_half_even", "round_half_away", "round_with"]


def round_half_even(x: torch.Tensor) -> torch.Tensor:
    """Nearest integer, ties to even (RNE); same dtype as x."""
    return torch.round(x)


def round_half_away(x: torch.Tensor) -> torch.Tensor:
    """Nearest integer, ties away from zero (C roundf); same dtype as x.

    Computed as sign(x) * floor(|x| + 0.5) in float64: in fp32 the sum |x| + 0.5
    can itself round up (0.49999997 + 0.5 -> 1.0), float64 holds it exactly.
    """
    xd = x.to(torch.float64)
    return (torch.sign(xd) * torch.floor(xd.abs() + 0.5)).to(x.dtype)


def round_with(x: torch.Tensor, rounding: Rounding) -> torch.Tensor:
    if rounding is Rounding.HALF_EVEN:
        return round_half_even(x)
    if rounding is Rounding.HALF_AWAY:
        return round_half_away(x)
    raise ValueError(f"unknown rounding {rounding!r}; valid: {[r.value for r in Rounding]}")
