"""What a Quamba2 W8A8 checkpoint stores beyond the q2-w8a8 mode's calibration: the SSM state scales of the
decode step and, with a quantized lm_head, its input scale (enyac-group/Quamba c474646).

Both come from ``run_quamba2_calibration`` (quamba/modelutils_mamba.py:236-372) on the reordered fp16 model:

* ``ssm_state_act:input`` (:288-298): ``CachedStatesCrossHeadMinmaxObserver`` (quamba/observer.py:262-366,
  sym, clip 1) of each block's final SSM state, stored fp16 in the inference cache (qMamba2.py:256-259 copies
  it into the fp16 cache that ``allocate_inference_cache`` made in the model's dtype). Per (SSD group, head
  group, dim group), the running max over samples of max(|state| over the group's heads and head channels,
  1e-5), one value per state column: a (ngroups, 4, 4, d_state) table; scale = max / 127 in fp32, at least
  1e-6 (:16-31). Quamba2ChunkScan stores it as ``ssm_state_scale`` (qChunkScan.py:113-117, 143-155).
* ``lm_head:input`` (:318-325): per-tensor min-max of the final norm's fp16 output (norm_f's weight is folded
  into lm_head, modelutils_mamba.py:91-95).

The harness runs these on the rotated fp16 calibration model with the reordered weights (emulation.q2_calibration),
one more pass over the calibration windows.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..spec import FloatOut, HookPoint, Mamba2Dims
from .build import build_mamba2_block
from .grouping_q2 import GroupReorder
from .modules import EmuBackbone, EmuRMSNorm
from .observers import MinMaxObserver
from .q2_params import reorder_raw
from .weights_mamba2 import float_layer_mamba2

__all__ = ["CachedStatesObserver", "q2_export_scales"]


class CachedStatesObserver:
    """quamba/observer.py:262-366 with sym=True: the per-group, per-state-column running max of |state|."""

    def __init__(self, ngroups: int, reorder: GroupReorder) -> None:
        self.ngroups = ngroups
        self.head_groups, self.dim_groups = reorder.head_groups.tolist(), reorder.dim_groups.tolist()
        self.amax: torch.Tensor | None = None

    def update(self, state: torch.Tensor) -> None:
        """state: (batch, nheads, headdim, d_state), the reordered model's final state (fp16 values)."""
        b, h, p, n = state.shape
        w = state.to(torch.float16).to(torch.float32).reshape(b, self.ngroups, h // self.ngroups, p, n)  # the fp16 cache
        table = torch.empty(self.ngroups, len(self.head_groups[0]), len(self.dim_groups[0][0]), n)
        for g in range(self.ngroups):
            h0 = 0
            for hg, h_size in enumerate(self.head_groups[g]):
                d0 = 0
                for dg, d_size in enumerate(self.dim_groups[g][hg]):
                    block = w[:, g, h0:h0 + h_size, d0:d0 + d_size, :]
                    table[g, hg, dg] = block.abs().amax(dim=(0, 1, 2)).clamp(min=1e-5)
                    d0 += d_size
                h0 += h_size
        self.amax = table if self.amax is None else torch.maximum(self.amax, table)

    def scales(self) -> torch.Tensor:
        return (self.amax / 127).to(torch.float32).clamp(min=1e-6)


def q2_export_scales(dims: Mamba2Dims, raw: Callable[[int], dict], embed: Callable, windows: torch.Tensor,
                     reorders: list[GroupReorder], batch_size: int, recipe, *,
                     step: Callable | None = None) -> tuple[list[torch.Tensor], float]:
    """(ssm_state_scale per block, lm_head's input scale) over every block (module docstring). raw(i): block
    i's float tensors; embed: the rotated fp16 embedding; reorders: each block's calibrated groups; recipe:
    the float calibration recipe (modes.Q2_CALIBRATION_RECIPE)."""
    blocks = [build_mamba2_block(recipe, float_layer_mamba2(reorder_raw(raw(i), r, dims.d_inner, dims.nheads),
                                                            True, torch.float16), dims, i)
              for i, r in enumerate(reorders)]
    model = EmuBackbone(embed, blocks)
    states = [CachedStatesObserver(dims.ngroups, r) for r in reorders]
    handles = [m.register_forward_hook(lambda _m, _i, out, o=states[m.layer]: o.update(out))
               for m in model.modules() if isinstance(m, HookPoint) and m.point == "ssd.state"]
    norm, head_in = EmuRMSNorm(None, dims.norm_eps, FloatOut(torch.float16)), MinMaxObserver()
    try:
        for batch in windows.split(batch_size):
            head_in.observe(norm(model(batch)))
            if step is not None:
                step()
    finally:
        for h in handles:
            h.remove()
    return [o.scales() for o in states], head_in.compute_scale()
