"""The W8A8 linear recipe of a hybrid's attention and MLP blocks (modes ``q2-w8a8-a8``, ``-kv8``, ``-kvfp8``):
static per-tensor int8 activations at every linear's input (min-max, calibrated on the same rotated fp16 model
and in the same pass as Quamba2's scales of the Mamba-2 blocks), per-channel (per output row) int8 weights, and
the KV cache in fp16, int8 (static per-tensor scale of k and of v) or fp8 E4M3 (per-tensor absmax per call,
kernels.formats). This is the generic SmoothQuant-less W8A8 of an LLM's linears: Quamba has no attention recipe.

Where an input is quantized (``LinearScales``): s_in the block's RMSNorm output (q, k, v's input, or gate and up's),
s_mid attn.out (o_proj's input) or mlp.hidden (down_proj's input), s_k and s_v the KV cache's (attention only).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..observers import MinMaxObserver

__all__ = ["LinearScales", "linear_observers", "linear_scales", "KV_FORMATS"]

# point of the block -> the scale it gives, by block kind
_POINTS = {"attention": {"norm.out": "s_in", "attn.out": "s_mid", "attn.k": "s_k", "attn.v": "s_v"},
           "mlp": {"norm.out": "s_in", "mlp.hidden": "s_mid"}}
KV_FORMATS = ("fp16", "int8", "fp8_e4m3")  # the KV cache knob's values


@dataclass(frozen=True)
class LinearScales:
    """The static activation scales of one attention or MLP block (module docstring)."""

    s_in: float
    s_mid: float
    s_k: float | None = None
    s_v: float | None = None

    def info(self) -> dict:
        return asdict(self)

    def floats(self) -> list[tuple[str, float]]:
        return [(k, v) for k, v in asdict(self).items() if v is not None]


def linear_observers(kind: str) -> dict[str, MinMaxObserver]:
    """point -> its observer, for a block of `kind` ("attention" or "mlp")."""
    return {point: MinMaxObserver() for point in _POINTS[kind]}


def linear_scales(kind: str, observers: dict[str, MinMaxObserver]) -> LinearScales:
    return LinearScales(**{_POINTS[kind][p]: o.compute_scale() for p, o in observers.items()})
