"""Segment diagnostics of the virtual-quantization taps (the Quamba-SE modes, harness.recipes.se): per layer and tap,
how many elements fell in each segment or grid of the quantizer (small / normal / outlier, log2 tail, high / mid
/ low) and each segment's share of the squared quantization error sum((u - x)^2), summed over the samples.
A block that has them sets ``segments`` to (tap, names, counts, squared errors) after each forward."""
from __future__ import annotations

__all__ = ["SegmentSums"]


class SegmentSums:
    """The running sums of one block's segments (module docstring)."""

    def __init__(self, tap: str, names: tuple[str, ...]) -> None:
        self.tap, self.names = tap, tuple(names)
        self.count, self.sq_err = [0] * len(names), [0.0] * len(names)

    def add(self, counts: list[int], sq_err: list[float]) -> None:
        self.count = [a + b for a, b in zip(self.count, counts)]
        self.sq_err = [a + b for a, b in zip(self.sq_err, sq_err)]

    def merge(self, other: "SegmentSums") -> None:
        """Add another unit's sums (in sample order)."""
        self.add(other.count, other.sq_err)

    def stats(self) -> dict:
        """The stats entry ``se_segments``: {tap: {segment: {fraction, error_share, count}}}."""
        n, total = sum(self.count), sum(self.sq_err)
        return {self.tap: {name: {"fraction": c / n if n else 0.0, "error_share": e / total if total > 0 else 0.0,
                                  "count": c}
                           for name, c, e in zip(self.names, self.count, self.sq_err)}}
