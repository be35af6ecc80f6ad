"""The int4 weight of Quamba2's W4A8 and W4A16 linears, as codes and scales before Marlin packs them.

GPTQ (enyac-group/Quamba c474646 quamba/gptq_utils.py:65-85, group 128) gives each output channel's group of
128 input columns a float32 scale ``amax * 2/15`` and codes ``clamp(round(w / scale) + 8, 0, 15)``; Marlin
(W4A16) stores the codes packed with fp16 group scales, Marlin-QQQ (W4A8) stores fp16 group scales divided
by an fp32 per-output-channel scale (quamba/marlin_utils.py:221-279). This container holds what both
share, unpacked: the producer (GPTQ on CPU, or a Quamba2 checkpoint's Marlin tensors unpacked) fills it,
the W4 linears read it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ZERO_POINT", "Int4Weight"]

ZERO_POINT = 8  # the uint4 code that means 0 (gptq_utils.py:65-85; marlin_utils.py)


@dataclass(frozen=True)
class Int4Weight:
    """codes: uint8 [out, in] in 0..15 (value ∝ code - 8); group_scales: float16 [out, in // group_size];
    channel_scales: float32 [out] for Marlin-QQQ (W4A8), None for Marlin (W4A16)."""

    codes: torch.Tensor
    group_scales: torch.Tensor
    channel_scales: torch.Tensor | None
    group_size: int = 128

    def __post_init__(self) -> None:
        out, inp = self.codes.shape
        if self.codes.dtype != torch.uint8 or int(self.codes.max()) > 15:
            raise ValueError("Int4Weight.codes must be uint8 in 0..15")
        if inp % self.group_size:
            raise ValueError(f"in_features {inp} is not a multiple of the group size {self.group_size}")
        if tuple(self.group_scales.shape) != (out, inp // self.group_size):
            raise ValueError(f"group_scales has shape {tuple(self.group_scales.shape)}, "
                             f"expected {(out, inp // self.group_size)}")
        if self.channel_scales is not None and tuple(self.channel_scales.shape) != (out,):
            raise ValueError(f"channel_scales has shape {tuple(self.channel_scales.shape)}, expected {(out,)}")

    def info(self) -> dict:
        """What the stats record of the weight: its group size, the sum of its codes, its largest group scale."""
        return {"group_size": self.group_size, "codes_sum": int(self.codes.to(torch.int64).sum()),
                "group_scale_max": float(self.group_scales.to(torch.float32).max())}

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]
