"""What every recipe's blocks share: the activation dtype of a recipe, where a backbone takes its weights from
(``WeightSource``), and whether Quamba's Hadamard kernels take a rotated width. The blocks themselves are built by
each architecture's knob interpreter (harness.architectures.*/build.py) or a recipe family's own builder
(harness.recipes.*), and assembled by harness.runner.backbone.
"""
from __future__ import annotations

from typing import Protocol

import torch

from ..kernels.formats import FORMATS, fake_quantize
from ..kernels.hadamard import quamba_kernel_support
from ..modes import ModeRecipe, NumberFormat, Rotate
from ..spec import FLOAT_DTYPES, FORMAT_NAMES, FormatOut, ModelDims, OutSpec

assert tuple(f.value for f in NumberFormat)[1:] == FORMAT_NAMES, "modes.NumberFormat must list spec.FORMAT_NAMES"

__all__ = ["act_dtype", "hadamard_kernel_support", "WeightSource", "fits_format", "format_out", "format_weight"]


def act_dtype(recipe: ModeRecipe) -> torch.dtype:
    return FLOAT_DTYPES[recipe.act_dtype]


def fits_format(fmt, width: int) -> bool:
    """Whether a tensor whose last dimension is `width` takes format `fmt` (a block format needs a multiple)."""
    return not FORMATS[str(fmt)].block or width % FORMATS[str(fmt)].block == 0


def format_out(recipe: ModeRecipe, width: int, otherwise: OutSpec) -> OutSpec:
    """act_format at an activation point `width` wide; no format, or a width the format's block does not divide,
    keeps `otherwise` (the layer_formats of the stats record it)."""
    fmt = recipe.act_format
    return FormatOut(str(fmt)) if fmt != NumberFormat.NONE and fits_format(fmt, width) else otherwise


def format_weight(recipe: ModeRecipe, w: torch.Tensor) -> torch.Tensor:
    """weight_format on a linear weight (out, in), groups along in-features; kept when they do not fit."""
    fmt = recipe.weight_format
    return fake_quantize(w.to(torch.float32), str(fmt)) if fmt != NumberFormat.NONE and fits_format(fmt, w.shape[-1]) else w

class WeightSource(Protocol):
    """Where build_backbone takes a mode's weights from (harness.runner.weightbank.WeightBank)."""

    dims: ModelDims

    def layer(self, i: int, weights: str, rotate: bool, prep: str) -> object: ...

    def embed(self, ids: torch.Tensor, rotate: bool, dtype: torch.dtype, prep: str, weights: str) -> torch.Tensor: ...

    def raw(self, layer: int) -> dict: ...

def hadamard_kernel_support(recipes: list[ModeRecipe], dims: ModelDims) -> dict[str, str | None] | None:
    """For runs with a rotated mode: per rotated width ("d_model", "d_inner"), None when Quamba's
    Hadamard kernels transform it, else why not (kernels.hadamard.quamba_kernel_support). The harness
    rotates such widths all the same; the run warns and records it. None when no mode rotates."""
    if not any(r.rotate == Rotate.YES for r in recipes):
        return None
    return {"d_model": quamba_kernel_support(dims.d_model), "d_inner": quamba_kernel_support(dims.d_inner)}
