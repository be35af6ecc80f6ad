"""`harness.formats`: the number formats (../shared/reference/formats.md), ``FORMATS`` and
``fake_quantize(x, fmt)``; the implementation is harness.kernels.formats (the recipes use it from there).

    from harness.formats import FORMATS, fake_quantize
    y = fake_quantize(torch.randn(4, 64), "mxfp4_e2m1")   # float32 in, float32 out, same shape
"""
from .kernels.formats import FORMATS, Format, fake_quantize

__all__ = ["FORMATS", "Format", "fake_quantize"]
