"""lm_head's input scale for the modes with lm_head=quantized (docs/modes.md "Embedding and lm_head"), observed once
per run after Quamba2's calibration and cached beside it.

quantize_fp16_model quantizes lm_head at ``act_scales[-1]["lm_head:input"]`` (enyac-group/Quamba c474646
quamba/modelutils_mamba.py:649-655), which run_quamba2_calibration observes (:318-325): recipes.quamba.q2.lm_head_scale
runs that observer (the export's --quantize_lm_head uses the same). The cache entry (runner.layercache, kind
"calib-q2-head") has a key chaining the last block's calibration key (the whole model, the calibration tokens and
settings) with "lm_head"; an entry the cache refuses, or whose scale is not finite and positive, is reported and
recomputed ("lm_head_input_scale_source": "recomputed", with its "lm_head_input_scale_reason"). The value lands in
the calibration's info ("lm_head_input_scale"), where RunContext.head_scale hands it to the mode's Forward.
"""
from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch

from .lm_head_scale import q2_lm_head_scale
from ....modes import Q2_CALIBRATION_RECIPE, LmHead, ModeRecipe
from ....runtime.guard import Progress
from ....runtime.log import warn
from ....runner.calibration import CalibrationResult, CalibrationSettings
from ....runner.layercache import BadEntry, LayerCache
from ....runner.weightbank import WeightBank

__all__ = ["observe_head_scales", "CACHE_KIND"]

CACHE_KIND = "calib-q2-head"  # runner.layercache: one entry per calibration, payload {"lm_head_input_scale": ...}


def observe_head_scales(calibs: dict, recipes: list[ModeRecipe], bank: WeightBank, windows: torch.Tensor,
                        settings: CalibrationSettings, cache_dir: Path | None, progress: Progress) -> None:
    """Add "lm_head_input_scale" to the calibration of every recipe with lm_head=quantized (all blocks calibrated)."""
    for key in dict.fromkeys(r.calibration_key for r in recipes if r.lm_head == LmHead.QUANTIZED):
        result = calibs.get(key)
        if not isinstance(result, CalibrationResult) or len(result.scales) != bank.dims.n_layer \
                or "keys" not in result.info:
            continue  # failed, not every block (no --end-to-end: no head), or a checkpoint's scales (no windows)
        if "lm_head_input_scale" not in result.info:
            _observe(result, bank, windows, settings, cache_dir, progress)


def _observe(result: CalibrationResult, bank: WeightBank, windows: torch.Tensor, settings: CalibrationSettings,
             cache_dir: Path | None, progress: Progress) -> None:
    key = hashlib.sha256((result.info["keys"][-1] + "|lm_head").encode()).hexdigest()
    cache = LayerCache(cache_dir, CACHE_KIND, max_bytes=1 << 16)  # an entry is a few hundred bytes
    scale, problem = _read(cache, key)
    source = "reused"
    if scale is None:
        if problem:
            warn(f"{problem}; recomputing lm_head's input scale")
        embed = lambda ids: bank.embed(ids, True, torch.float16, "exact", "fp16")  # noqa: E731  (calibration model's)
        with progress.stage("observing lm_head's input", -(-windows.shape[0] // settings.batch_size), "batches"):
            scale = q2_lm_head_scale(bank.dims, bank.raw, embed, windows, [s.reorder for s in result.scales],
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
