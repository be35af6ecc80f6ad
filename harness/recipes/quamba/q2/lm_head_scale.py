"""What a Quamba2 W8A8 checkpoint stores beyond the q2-w8a8 mode's scales: with a quantized lm_head, its input
scale (enyac-group/Quamba c474646).

``run_quamba2_calibration`` (quamba/modelutils_mamba.py:236-372) observes ``lm_head:input`` (:318-325): the
per-tensor min-max of the final norm's fp16 output (norm_f's weight is folded into lm_head,
modelutils_mamba.py:91-95). The harness runs it on the rotated fp16 calibration model with the reordered weights
(recipes.quamba.q2.calibration), one more pass over the calibration windows. (The SSM state scales that the checkpoint
also stores are observed by the calibration itself: emulation.observers_q2.CachedStatesObserver.)
"""
from __future__ import annotations

from typing import Callable

import torch

from ....spec import FloatOut, Mamba2Dims
from ....architectures.mamba2.build import build_mamba2_block
from .grouping import GroupReorder
from ....emulation.modules import EmuBackbone, EmuRMSNorm
from ..observers import MinMaxObserver
from .params import reorder_raw
from ....architectures.mamba2.weights import float_layer_mamba2

__all__ = ["q2_lm_head_scale"]


def q2_lm_head_scale(dims: Mamba2Dims, raw: Callable[[int], dict], embed: Callable, windows: torch.Tensor,
                     reorders: list[GroupReorder], batch_size: int, recipe, *, step: Callable | None = None) -> float:
    """lm_head's input scale over every block (module docstring). raw(i): block
    i's float tensors; embed: the rotated fp16 embedding; reorders: each block's calibrated groups; recipe:
    the float calibration recipe (modes.Q2_CALIBRATION_RECIPE)."""
    blocks = [build_mamba2_block(recipe, float_layer_mamba2(reorder_raw(raw(i), r, dims.d_inner, dims.nheads),
                                                            True, torch.float16), dims, i)
              for i, r in enumerate(reorders)]
    model = EmuBackbone(embed, blocks)
    norm, head_in = EmuRMSNorm(None, dims.norm_eps, FloatOut(torch.float16)), MinMaxObserver()
    for batch in windows.split(batch_size):
        head_in.observe(norm(model(batch)))
        if step is not None:
            step()
    return head_in.compute_scale()
