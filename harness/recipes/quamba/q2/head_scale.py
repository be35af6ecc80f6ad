"""lm_head's input scale for the modes with lm_head=quantized (docs/modes.md "Embedding and lm_head"), observed once
per run after Quamba2's calibration and cached beside it.

quantize_fp16_model quantizes lm_head at ``act_scales[-1]["lm_head:input"]`` (enyac-group/Quamba c474646
quamba/modelutils_mamba.py:649-655), which run_quamba2_calibration observes (:318-325): recipes.quamba.q2.lm_head_scale
runs that observer (the export's --quantize_lm_head uses the same). The cache entry (runner.layercache, kind
"calib-q2-head") has a key chaining the last block's calibration key (the whole model, the calibration tokens and
settings) with "lm_head"; an entry the cache refuses, or whose scale is not finite and positive, is reported and
recomputed ("lm_head_input_scale_source": "recomputed", with its "lm_head_input_scale_reason"). The value lands in
the calibration's info ("lm_head_input_scale"), where RunContext.head_scale hands it to the mode's Forward.

The W4A8 recipes (q2-w4a8, q2-w4ax) quantize their head at the same scale: quantize_model_mamba runs the same
run_quamba2_calibration on the same reordered fp16 model before GPTQ (modelutils_mamba.py:801-812), and
quantize_fp16_model / quantize_fp16_model_act_hybrid read ``act_scales[-1]["lm_head:input"]`` (:653-657, :740-743).
Their calibration holds q2-w8a8's as info["w8a8"]: the entry's key chains that calibration's last key, so one entry
serves q2-w8a8 and both W4A8 recipes. q2-w4a16 quantizes no activation (its W4A16B16O16Linear takes norm_f's fp16
output, :650-652): it needs no scale.
"""
from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Callable

import torch

from .lm_head_scale import q2_lm_head_scale
from ....modes import Q2_CALIBRATION_RECIPE, LmHead, ModeRecipe, Store, Weights
from ....runtime.guard import Progress
from ....runtime.log import warn
from ....runner.calibration import CalibrationResult, CalibrationSettings
from ....runner.layercache import BadEntry, LayerCache
from ....runner.weightbank import WeightBank

__all__ = ["observe_head_scales", "needs_head_scale", "head_problem", "CACHE_KIND"]

CACHE_KIND = "calib-q2-head"  # runner.layercache: one entry per calibration, payload {"lm_head_input_scale": ...}


def observe_head_scales(calibs: dict, recipes: list[ModeRecipe], bank: WeightBank, windows: torch.Tensor,
                        settings: CalibrationSettings, cache_dir: Path | None, progress: Progress, *,
                        key_of: Callable[[ModeRecipe], str | None] = lambda r: r.calibration_key) -> None:
    """Add "lm_head_input_scale" to the calibration of every recipe that needs one (all blocks calibrated);
    key_of: the family's calibration key of a recipe (Recipe.calibration_key: q2-w4ax's is its own)."""
    for key in dict.fromkeys(key_of(r) for r in recipes if needs_head_scale(r)):
        result = calibs.get(key)
        if not isinstance(result, CalibrationResult) or len(result.scales) != bank.dims.n_layer \
                or "keys" not in _w8a8_info(result):
            continue  # failed, not every block (no --end-to-end: no head), or a checkpoint's scales (no windows)
        if "lm_head_input_scale" not in result.info:
            _observe(result, bank, windows, settings, cache_dir, progress)


def needs_head_scale(r: ModeRecipe) -> bool:
    """lm_head=quantized behind QRMSNorm: q2-w8a8's W8A8B16O16Linear, the W4A8B16O16Linear of q2-w4a8 / q2-w4ax
    (int4 weights with int8 activations); not q2-w4a16's W4A16B16O16Linear (module docstring)."""
    return r.lm_head == LmHead.QUANTIZED and not (r.weights == Weights.INT4 and r.norm_out != Store.INT8)


def head_problem(r: ModeRecipe, architecture: str) -> str | None:
    """lm_head=quantized runs on Mamba-2 models only: the lm_head:input observer (q2.lm_head_scale) runs Mamba-2
    blocks, and quantize_fp16_model quantizes the head of model_type "mamba2" only (modelutils_mamba.py:644-645)."""
    if r.lm_head != LmHead.QUANTIZED or architecture == "mamba2":
        return None
    return (f"lm_head=quantized runs on mamba2 models only (the lm_head:input observer runs Mamba-2 blocks); "
            f"on this {architecture} model use lm_head=fp16")


def _w8a8_info(result: CalibrationResult) -> dict:
    """The info of the W8A8 calibration behind `result`: its own, or a W4A8 one's info["w8a8"]."""
    return result.info.get("w8a8", result.info)


def _reorders(result: CalibrationResult) -> list:
    """Each block's head/dim groups: a Q2Scales' reorder, or a W4A8 layer's (Q2W4Layer, W4AXLayer) W8A8 scales'."""
    return [s.reorder if hasattr(s, "reorder") else s.scales.reorder for s in result.scales]


def _observe(result: CalibrationResult, bank: WeightBank, windows: torch.Tensor, settings: CalibrationSettings,
             cache_dir: Path | None, progress: Progress) -> None:
    key = hashlib.sha256((_w8a8_info(result)["keys"][-1] + "|lm_head").encode()).hexdigest()
    cache = LayerCache(cache_dir, CACHE_KIND, max_bytes=1 << 16)  # an entry is a few hundred bytes
    scale, problem = _read(cache, key)
    source = "reused"
    if scale is None:
        if problem:
            warn(f"{problem}; recomputing lm_head's input scale")
        embed = lambda ids: bank.embed(ids, True, torch.float16, "exact", "fp16")  # noqa: E731  (calibration model's)
        with progress.stage("observing lm_head's input", -(-windows.shape[0] // settings.batch_size), "batches"):
            scale = q2_lm_head_scale(bank.dims, bank.raw, embed, windows, _reorders(result),
                                     settings.batch_size, Q2_CALIBRATION_RECIPE, step=progress.advance)
        source = "recomputed" if problem else "computed"
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"lm_head's input scale {scale} is not finite and positive; nothing was cached")
        if cache.enabled:
            try:
                cache.write(key, {"lm_head_input_scale": scale})
            except OSError as e:
                warn(f"cannot write lm_head's input scale to {cache.path(key)} ({e.strerror}); it is not cached")
    result.info.update(lm_head_input_scale=scale, lm_head_input_scale_source=source)
    if problem:
        result.info["lm_head_input_scale_reason"] = problem


def _read(cache: LayerCache, key: str) -> tuple[float | None, str]:
    """The cached scale (None: no entry, or a bad one) and the problem to report ('' if none): an entry the cache
    refuses, or whose scale is not a finite positive number, is reported and recomputed."""
    try:
        entry = cache.read(key) if cache.enabled else None
    except BadEntry as e:
        return None, f"lm_head's input scale cache file {cache.path(key)} is corrupted: {e}"
    if entry is None:
        return None, ""
    v = entry.payload.get("lm_head_input_scale")
    if not (isinstance(v, float) and math.isfinite(v) and v > 0):
        return None, f"lm_head's input scale cache file {cache.path(key)} is corrupted: the scale {v!r} is not " \
                     "a finite positive number"
    return v, ""
