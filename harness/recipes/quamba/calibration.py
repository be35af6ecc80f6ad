"""Calibration: one pass of the rotated fp16 model over the calibration windows, cached on disk.

One calibration per weight preparation (``prep``), shared by every mode of that
prep: prep=quamba runs Quamba's fp16 model (Quamba-prepared fp16 weights, the
fp16 conv output before SiLU, mamba_ssm's scan; harness.emulation.build), prep=exact the
model of before the knob existed (exact fp16 weights, fp32 conv output, the
reference scan). Scales depend on the prep, the model (embedding and blocks up
to the layer), the calibration tokens and the settings. Each layer's scales and
its observers' state are cached in their own entry (runner.layercache, kind
"calib") under a key that chains those inputs, so a run that needs layers 0..d
reads exactly d + 1 files and never the weights of deeper layers; a run from the
cache records what the fresh run recorded (the observers' state too). An entry
that the cache refuses (checksum, format, key, special or large file, ...) or
whose scales are not finite and positive is reported and recomputed, never used;
computed scales that are not finite and positive are an error (the quantized
modes fail with it) and are never written to the cache.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from ...runtime.log import warn
from ...runner.backbone import build_backbone
from ...runtime.guard import Progress, fault_point
from ...modes import CALIBRATION_RECIPES
from .observers import MinMaxObserver, PercentileObserver
from ...spec import SCALE_NAMES, HookPoint, LayerScales
from ...runner.calibcost import estimate_seconds
from ...runner.calibration import CALIB_VERSION, CalibrationResult, CalibrationSettings, layer_keys
from ...runner.layercache import Entry, LayerCache
from ...runner.weightbank import WeightBank

__all__ = ["calibrate", "run_observers", "OBSERVED_AT", "CACHE_KIND"]

CACHE_KIND = "calib"  # runner.layercache: one entry per layer, payload _payload, no arrays
_MAX_CACHE_BYTES = 1 << 24  # an entry is about 3 KB; a larger (or special) file there is not one

# scale -> (capture point observed, observer kind); spec notes §2.3-2.4
OBSERVED_AT: dict[str, tuple[str, str]] = {
    "s_in": ("norm.out", "minmax"),
    "s_xz": ("in_proj.out", "minmax"),
    "s_u": ("conv1d.out", "percentile"),
    "s_xp": ("x_proj.out", "minmax"),
    "s_dt": ("dt_proj.out", "minmax"),
    "s_h": ("ssm.state", "percentile"),
    "s_H": ("had.out", "minmax"),
}


def run_observers(bank: WeightBank, windows: torch.Tensor, depth: int, alpha: float,
                  batch_size: int, prep: str = "quamba", *,
                  step: Callable[[], None] | None = None) -> tuple[list[LayerScales], list[dict]]:
    """Forward the windows (num, seqlen) through the calibration model of `prep` in batches; scales of layers
    0..depth. step: called after each batch (progress)."""
    model = build_backbone(CALIBRATION_RECIPES[prep], bank, None, depth, calibration=True)
    observers = [{name: (PercentileObserver(alpha) if kind == "percentile" else MinMaxObserver())
                  for name, (_, kind) in OBSERVED_AT.items()} for _ in range(depth + 1)]
    by_point = {(layer, point): observers[layer][name]
                for layer in range(depth + 1) for name, (point, _) in OBSERVED_AT.items()}
    handles = []
    try:
        for module in model.modules():
            obs = by_point.get((module.layer, module.point)) if isinstance(module, HookPoint) else None
            if obs is not None:
                handles.append(module.register_forward_hook(lambda _m, _i, out, obs=obs: obs.observe(out)))
        for batch in windows.split(batch_size):
            model(batch)
            fault_point("calibration")
            if step is not None:
                step()
    finally:
        for handle in handles:
            handle.remove()
    scales = [LayerScales(**{name: obs.compute_scale() for name, obs in layer_obs.items()}) for layer_obs in observers]
    states = [{name: obs.state() for name, obs in layer_obs.items()} for layer_obs in observers]
    return scales, states


def _cache(cache_dir: Path | None) -> LayerCache:
    return LayerCache(cache_dir, CACHE_KIND, max_bytes=_MAX_CACHE_BYTES)


def _parse_entry(entry: Entry) -> tuple[LayerScales, dict]:
    """A layer's scales and its observers' state from a cache entry; ValueError (with the reason) for an entry
    whose scales are missing or not finite and positive, or that holds no observers' state."""
    try:
        scales = LayerScales(**{n: float(entry.payload["scales"][n]) for n in SCALE_NAMES})
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"bad scales ({e})") from None
    bad = _bad_scales(scales)
    if bad:
        raise ValueError(f"scales that are not finite and positive: {bad}")
    observers = entry.payload.get("observers")
    if not isinstance(observers, dict) or set(observers) != set(SCALE_NAMES):
        raise ValueError("bad observers' state (one per scale)")
    return scales, observers


def _bad_scales(scales: LayerScales) -> str:
    """'s_xz=inf, s_u=0.0' for every scale that is NaN, infinite, zero or negative ('' if none)."""
    return ", ".join(f"{n}={v}" for n, v in scales.as_dict().items() if not (math.isfinite(v) and v > 0))


def _payload(layer: int, scales: LayerScales, state: dict, settings: CalibrationSettings, prep: str) -> dict:
    return {"version": CALIB_VERSION, "layer": layer, "prep": prep, "scales": scales.as_dict(), "observers": state,
            "settings": asdict(settings)}


def calibrate(bank: WeightBank, windows: torch.Tensor, settings: CalibrationSettings, depth: int,
              prefix_hashes: list[str], cache_dir: Path | None, prep: str = "quamba", *,
              progress: Progress | None = None) -> CalibrationResult:
    """Scales of layers 0..depth for modes of `prep`, from the cache when every layer's entry is valid, else computed.
    progress: shown the computation (batches, an estimate of its time: ``calibcost``)."""
    keys = layer_keys(prefix_hashes[: depth + 1], windows, settings, prep)
    info: dict = {"prep": prep, "settings": asdict(settings), "keys": keys, "tokens": int(windows.numel())}
    cache = _cache(cache_dir)
    cached, problems = cache.read_layers(keys, lambda _layer, entry: _parse_entry(entry), "cache file")
    if cache.enabled and len(cached) == depth + 1:  # what a fresh run records, the observers' state too (issue 35)
        return CalibrationResult([s for s, _ in cached], {**info, "source": "reused", "seconds": 0.0,
                                                          "observers": [o for _, o in cached],
                                                          "cache_files": [str(cache.path(k)) for k in keys]})
    for problem in problems:
        warn(f"{problem}; recomputing the calibration")
    start = time.perf_counter()
    progress = Progress() if progress is None else progress
    batches = -(-windows.shape[0] // settings.batch_size)
    estimate = estimate_seconds(int(windows.numel()), depth + 1, bank.dims)
    with progress.stage(f"calibrating (prep={prep}, {windows.shape[0]} x {windows.shape[1]} tokens, "
                        f"layers 0..{depth})", batches, "batches", estimate):
        scales, states = run_observers(bank, windows, depth, settings.alpha, settings.batch_size, prep,
                                       step=progress.advance)
    for layer, layer_scales in enumerate(scales):
        bad = _bad_scales(layer_scales)
        if bad:  # never cached, never used
            raise ValueError(f"calibration gave scales that are not finite and positive in layer {layer}: {bad} "
                             f"(the fp16 calibration activations overflow or are all zero); nothing was cached")
    info.update(source="recomputed" if problems else "computed", seconds=round(time.perf_counter() - start, 3),
                observers=states)
    if problems:
        info["reason"] = "; ".join(problems)
    if cache.enabled:
        try:
            entries = [(_payload(i, s, st, settings, prep), None) for i, (s, st) in enumerate(zip(scales, states))]
            info["cache_files"] = cache.write_layers(keys, entries)
        except OSError as e:
            warn(f"cannot write the calibration cache in {cache_dir} ({e.strerror}); "
                 "the scales of this run are not cached")
            info["cache_error"] = str(e)
    return CalibrationResult(scales, info)
