"""The rounding rules every quantizer names: ties to even (RNE), ties away from zero (C roundf)."""
from __future__ import annotations

import torch

from ..spec import Rounding

__all__ = ["round_half_even", "round_half_away", "round_half_away_fp32", "round_with"]


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


def round_half_away_fp32(x: torch.Tensor) -> torch.Tensor:
    """Ties away from zero as the Quamba-SE fork writes it in PyTorch, ``roundf_like`` (798253405/Quamba-SE f4d350a
    quamba/qMambaLayer.py:1433-1435): where(x >= 0, floor(x + 0.5), ceil(x - 0.5)) with the sum rounded to fp32
    first, so 0.49999997 -> 1 (C roundf: 0) and odd |x| >= 2**23 move by one. fp32 in, fp32 out."""
    x = x.to(torch.float32)
    half = torch.tensor(0.5, dtype=torch.float32)
    return torch.where(x >= 0, torch.floor(x + half), torch.ceil(x - half))


def round_with(x: torch.Tensor, rounding: Rounding) -> torch.Tensor:
    if rounding is Rounding.HALF_EVEN:
        return round_half_even(x)
    if rounding is Rounding.HALF_AWAY:
        return round_half_away(x)
    raise ValueError(f"unknown rounding {rounding!r}; valid: {[r.value for r in Rounding]}")
