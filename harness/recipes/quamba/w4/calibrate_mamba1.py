"""Quamba2's W4A8 / W4A16 calibration of a Mamba-1 model: Quamba's GPTQ on CPU (recipes.quamba.w4.gptq_mamba1), cached on disk.

Calibration keys (``ModeRecipe.calibration_key``, as on Mamba-2): "quamba2-w4a8" is mode 0's calibration
(prep=quamba, its own cache: Quamba2 calibrates a Mamba-1 model with ``run_quamba_calibration``,
quamba/modelutils_mamba.py:802-818, as Quamba1) followed by GPTQ; "quamba2-w4a16" is GPTQ alone (no activation
calibration, :820-825). Either way GPTQ runs on the same prepared fp16 model (calibration does not change it for
Mamba-1: there is no reorder). The cache is calibrate_mamba2's (one entry per layer, chained keys); x_proj's
round-to-nearest int4 weight (kernels.int4) is computed from the fp16 weight, not cached.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from .gptq_mamba1 import gptq_mamba1
from .block_mamba1 import Q1W4Layer, q1w4_layer
from ....kernels.int4 import rtn_group_size
from ....runtime.guard import Progress
from ....runner.calibration import CalibrationResult, CalibrationSettings, layer_keys
from ..calibration import calibrate
from .calibrate_mamba2 import GPTQ_VERSION, cached_gptq, gptq_cache, gptq_info
from ....runner.weightbank import WeightBank

__all__ = ["calibrate_mamba1_w4"]


def calibrate_mamba1_w4(bank: WeightBank, windows: torch.Tensor, settings: CalibrationSettings, depth: int,
                        prefix_hashes: list[str], cache_dir: Path | None, key: str, *,
                        progress: Progress | None = None) -> CalibrationResult:
    """Q1W4Layer of blocks 0..depth for key "quamba2-w4a8" or "quamba2-w4a16" (module docstring)."""
    channel = key == "quamba2-w4a8"
    progress = Progress() if progress is None else progress
    w8a8 = calibrate(bank, windows, settings, depth, prefix_hashes, cache_dir, "quamba", progress=progress) \
        if channel else None
    keys = layer_keys(prefix_hashes[: depth + 1], windows, settings, f"{key}-mamba1-gptq-v{GPTQ_VERSION}")
    info = gptq_info(key, settings, windows, keys, bank.dims)
    info["x_proj"] = {"quantizer": "Marlin's round to nearest (Quamba c474646 quamba/marlin_utils.py:139-192, "
                                   "304-346)", "group_size": rtn_group_size(bank.dims.d_inner)}
    if w8a8 is not None:
        info["w8a8"] = w8a8.info
    start = time.perf_counter()

    def compute(step) -> list:
        params = [bank.layer(i, "fp16", True, "quamba") for i in range(depth + 1)]
        embed = lambda ids: bank.embed(ids, True, torch.float16, "quamba", "fp16")  # noqa: E731
        return gptq_mamba1(bank.dims, params, embed, windows, settings.batch_size, channel, step=step)

    weights = cached_gptq(gptq_cache(cache_dir, bank.dims), keys, bank.dims, channel, compute, info, progress,
                          depth=depth, tokens=windows.numel(),
                          title=f"GPTQ ({key}, Mamba-1, {windows.shape[0]} x {windows.shape[1]} tokens, layers 0..{depth})")
    layers: list[Q1W4Layer] = [
        q1w4_layer(w_in, w_out, bank.layer(i, "fp16", True, "quamba").x_proj,
                   w8a8.scales[i] if w8a8 is not None else None) for i, (w_in, w_out) in enumerate(weights)]
    info.update(seconds=round(time.perf_counter() - start, 3), layers=[x.info() for x in layers])
    return CalibrationResult(layers, info)
