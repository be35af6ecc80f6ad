"""The Quamba-SE modes' segment diagnostics (metrics.segments, stats ``modes.M.layers.Li.se_segments``): `compare`'s
text table, what --json gets, and the report's section. Per mode, layer and virtual-quantization tap: the fraction
of elements in each segment of the quantizer and the segment's share of the squared quantization error."""
from __future__ import annotations

from .html import section, table
from .layer_entries import layer_entries_of

__all__ = ["se_segments_of", "se_segment_text", "se_segment_section"]


def se_segments_of(stats: dict, modes: set[str] | None, layers: set[int] | None) -> dict:
    """mode -> "L{i}" -> the stored se_segments entry (all modes/layers when None), in the file's order."""
    return layer_entries_of(stats, "se_segments", modes, layers)


def _rows(segs: dict) -> list[tuple[str, str, str, str, str]]:
    """(mode, layer tap, segment, % of elements, % of the error) rows."""
    out = []
    for mode, layers in segs.items():
        for layer, taps in layers.items():
            for tap, per in taps.items():
                for name, v in per.items():
                    out.append((mode, f"{layer}.{tap}", name, f"{100 * v['fraction']:.4g}%",
                                f"{100 * v['error_share']:.4g}%"))
    return out


def se_segment_text(segs: dict) -> str:
    """The plain-text table `compare` prints."""
    rows = _rows(segs)
    if not rows:
        return ""
    head = ("mode", "tap", "segment", "elements", "error share")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join(["Quamba-SE segments (fraction of elements, share of the squared quantization error):",
                      line(head), *(line(r) for r in rows)])


def se_segment_section(stats: dict) -> str:
    """The report's section, or "" when no mode has segment diagnostics."""
    rows = _rows(se_segments_of(stats, None, None))
    if not rows:
        return ""
    return section("Quamba-SE segments", table(["mode", "tap", "segment", "elements", "error share"],
                                               rows, left=3), "se-segments",
                   "Per virtual-quantization tap of the Quamba-SE modes: the fraction of elements that fell in each "
                   "segment or grid of the quantizer, and that segment's share of the squared error sum((u - x)^2) "
                   "against the fp32 conv output x (docs/se-modes.md).")
