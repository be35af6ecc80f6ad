"""Quamba2's W8A8 calibration of a Mamba-2 model (prep=quamba2; emulation.q2_calibration), computed per run.

The scales and the head/dim groups are not cached on disk (the Mamba-1 cache holds per-tensor scales only):
every run that asks for q2-w8a8 computes them, in two passes over the calibration windows, and records every
scale table and group range in the provenance ("calibration_by_prep" -> "quamba2" -> "layers").
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict

import torch

from ..emulation.q2_calibration import calibrate_q2
from ..modes import Q2_CALIBRATION_RECIPE
from ..runtime.guard import Progress
from .calibration import CalibrationResult, CalibrationSettings
from .weightbank import WeightBank

__all__ = ["calibrate_quamba2"]


def _bad(info: dict) -> list[str]:
    flat = [(k, v) for k, v in info.items() if isinstance(v, float)]
    flat += [(k, x) for k in ("x_table", "B_scales", "C_scales") for x in torch.tensor(info[k]).flatten().tolist()]
    return [f"{k}={v}" for k, v in flat if not (math.isfinite(v) and v > 0)]


def calibrate_quamba2(bank: WeightBank, windows: torch.Tensor, settings: CalibrationSettings, depth: int, *,
                      progress: Progress | None = None) -> CalibrationResult:
    """Q2Scales of blocks 0..depth; a scale that is not finite and positive is a ValueError naming it."""
    start = time.perf_counter()
    progress = Progress() if progress is None else progress
    batches = -(-windows.shape[0] // settings.batch_size)
    embed = lambda ids: bank.embed(ids, True, torch.float16, "exact", "fp16")  # noqa: E731
    with progress.stage(f"calibrating (prep=quamba2, {windows.shape[0]} x {windows.shape[1]} tokens, "
                        f"layers 0..{depth}, two passes)", 2 * batches, "batches"):
        scales = calibrate_q2(bank.dims, bank.raw, embed, windows, depth, settings.batch_size, Q2_CALIBRATION_RECIPE,
                              step=progress.advance)
    layers = [s.info() for s in scales]
    for i, info in enumerate(layers):
        if bad := _bad(info):
            raise ValueError(f"Quamba2 calibration gave scales that are not finite and positive in layer {i}: "
                             f"{', '.join(bad)}")
    info = {"prep": "quamba2", "settings": asdict(settings), "tokens": int(windows.numel()), "source": "computed",
            "cached": False, "seconds": round(time.perf_counter() - start, 3),
            "observers": "min-max per tensor; cross-head min-max of x; per-SSD-group min-max of B, C "
                         "(Quamba c474646 quamba/modelutils_mamba.py:236-372)",
            "layers": layers}
    return CalibrationResult(scales, info)
