"""A calibration of per-layer statistics (scales, smoothing vectors, covariances), cached per layer like Quamba's
scales (runner.layercache): the field's other recipes (harness/recipes/naive, smq, mambaquant) calibrate through
it. A layer's statistics are a dict: floats go into the entry's JSON payload, tensors into its arrays (float64
arrays as they were computed). A cached layer is used only when every value is finite; the provenance records
the keys, the files, where the statistics came from and a summary of each (shape, min, max)."""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..runtime.log import warn
from .calibration import CALIB_VERSION, CalibrationResult, CalibrationSettings, layer_keys
from .layercache import Entry, LayerCache

__all__ = ["cached_statistics", "summarize", "LayerStats"]

LayerStats = dict[str, "float | torch.Tensor"]
_MAX_BYTES = 1 << 28  # a layer's covariances of mamba-2.8b (E = 5120): 4 x 200 MB would not fit; 256 MiB does


def _finite(stats: LayerStats) -> list[str]:
    bad = []
    for name, v in stats.items():
        ok = bool(torch.isfinite(v).all()) if isinstance(v, torch.Tensor) else math.isfinite(float(v))
        if not ok:
            bad.append(name)
    return bad


def _parse(_layer: int, entry: Entry) -> LayerStats:
    floats = entry.payload.get("floats")
    if not isinstance(floats, dict):
        raise ValueError("no statistics in the entry")
    stats: LayerStats = {k: float(v) for k, v in floats.items()}
    stats.update({k: torch.from_numpy(np.array(a)) for k, a in entry.arrays.items()})
    if bad := _finite(stats):
        raise ValueError(f"statistics that are not finite: {', '.join(bad)}")
    return stats


def _entry(layer: int, stats: LayerStats, name: str, settings: CalibrationSettings) -> tuple[dict, dict]:
    floats = {k: float(v) for k, v in stats.items() if not isinstance(v, torch.Tensor)}
    arrays = {k: v.detach().cpu().numpy() for k, v in stats.items() if isinstance(v, torch.Tensor)}
    return {"version": CALIB_VERSION, "layer": layer, "recipe": name, "floats": floats,
            "settings": asdict(settings)}, arrays


def summarize(stats: list[LayerStats]) -> list[dict]:
    """Per layer, per statistic: a float as it is, a tensor as {shape, min, max}."""
    out = []
    for layer in stats:
        row = {}
        for k, v in layer.items():
            row[k] = {"shape": list(v.shape), "min": float(v.min()), "max": float(v.max())} \
                if isinstance(v, torch.Tensor) and v.numel() else (v if not isinstance(v, torch.Tensor) else [])
        out.append(row)
    return out


def cached_statistics(kind: str, name: str, windows: torch.Tensor, settings: CalibrationSettings, depth: int,
                      prefix_hashes: list[str], cache_dir: Path | None, *,
                      compute: Callable[[], list[LayerStats]], extra: dict | None = None) -> CalibrationResult:
    """The statistics of layers 0..depth: from the cache (kind `kind`) when every layer's entry is valid, else
    compute() (a list of depth + 1 LayerStats), checked finite (a ValueError naming the statistic otherwise:
    never cached) and written. `extra`: what else the statistics depend on (a recipe's options), in the key."""
    tag = f"{name}|{json.dumps(extra or {}, sort_keys=True)}"
    keys = layer_keys(prefix_hashes[: depth + 1], windows, settings, tag)
    info: dict = {"prep": name, "recipe": name, "options": extra or {}, "settings": asdict(settings), "keys": keys,
                  "tokens": int(windows.numel())}
    cache = LayerCache(cache_dir, kind, max_bytes=_MAX_BYTES)
    cached, problems = cache.read_layers(keys, _parse, "cache file")
    if cache.enabled and len(cached) == depth + 1:
        return CalibrationResult(cached, {**info, "source": "reused", "seconds": 0.0, "statistics": summarize(cached),
                                          "cache_files": [str(cache.path(k)) for k in keys]})
    for problem in problems:
        warn(f"{problem}; recomputing the calibration")
    start = time.perf_counter()
    stats = compute()
    for layer, s in enumerate(stats):
        if bad := _finite(s):
            raise ValueError(f"calibration of {name} gave statistics that are not finite in layer {layer}: "
                             f"{', '.join(bad)}; nothing was cached")
    info.update(source="recomputed" if problems else "computed", seconds=round(time.perf_counter() - start, 3),
                statistics=summarize(stats))
    if problems:
        info["reason"] = "; ".join(problems)
    if cache.enabled:
        try:
            info["cache_files"] = cache.write_layers(keys, [_entry(i, s, name, settings) for i, s in enumerate(stats)])
        except OSError as e:
            warn(f"cannot write the calibration cache in {cache_dir} ({e.strerror}); the statistics of this run "
                 "are not cached")
            info["cache_error"] = str(e)
    return CalibrationResult(stats, info)
