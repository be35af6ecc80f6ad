"""Quamba2's W8A8 calibration of a Mamba-2 model (prep=quamba2; recipes.quamba.q2.calibration), cached on disk.

Every scale table and group range is recorded in the provenance ("calibration_by_prep" -> "quamba2" -> "layers").
The cache works as the Mamba-1 one (recipes.quamba.calibration): one entry per layer (runner.layercache, kind
"calib-q2": the scalar scales in its payload, the scale tables and groups as arrays), under a key chaining the model
up to that layer, the calibration tokens, the settings and "quamba2"; an entry that the cache refuses, or that holds
scales that are not finite and positive or groups that do not fit the model, is reported and recomputed.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from .grouping import GroupReorder
from .calibration import calibrate_q2
from .linear import LinearScales
from .params import Q2Scales
from ....architectures.bamba.build import is_ssm_block
from ....modes import Q2_CALIBRATION_RECIPE
from ....runtime.guard import Progress
from ....runtime.log import warn
from ....runner.calibcost import estimate_seconds
from ....runner.calibration import CalibrationResult, CalibrationSettings, layer_keys
from ....runner.layercache import Entry, LayerCache
from ....runner.weightbank import WeightBank

__all__ = ["calibrate_quamba2", "Q2_CALIB_VERSION", "CACHE_KIND"]

Q2_CALIB_VERSION = 4  # bump when anything that changes the computed scales or groups changes (2: s_x_tensor;
                      # 3: ssm_state_scale; 4: the fp16 model's A_log in fp16)
CACHE_KIND = "calib-q2"  # runner.layercache: one entry per layer (_entry)
_FLOATS = ("s_in", "s_z", "s_x", "s_B", "s_C", "s_dt", "s_H", "s_x_tensor")
_TABLES = ("x_table", "B_scales", "C_scales", "ssm_state_scale")
_GROUPS = ("channel_index", "head_index", "head_groups", "dim_groups")  # GroupReorder's fields, in order
_GROUP_DTYPES = (torch.int64, torch.int64, torch.int32, torch.int32)


def _cache(cache_dir: Path | None) -> LayerCache:
    return LayerCache(cache_dir, CACHE_KIND, max_bytes=1 << 24)  # an entry is a few KB


def _entry(layer: int, s: Q2Scales | LinearScales, settings: CalibrationSettings) -> tuple[dict, dict[str, np.ndarray]]:
    """A layer's cache entry: the scalar scales in the payload, the tables and groups as arrays (bit for bit); a
    hybrid's attention or MLP block: its linears' scales in the payload, no arrays."""
    payload = {"version": Q2_CALIB_VERSION, "layer": layer, "prep": "quamba2", "settings": asdict(settings)}
    if isinstance(s, LinearScales):
        return {**payload, "linear": s.info()}, {}
    payload["scales"] = {k: getattr(s, k) for k in _FLOATS}
    arrays = {k: getattr(s, k).numpy() for k in _TABLES}
    arrays.update({k: getattr(s.reorder, k).numpy() for k in _GROUPS})
    return payload, arrays


def _from_entry(entry: Entry, dims, layer: int) -> Q2Scales | LinearScales:
    """ValueError naming what does not fit the model (a hybrid's attention or MLP block: its linears' scales)."""
    if is_ssm_block(dims, layer) == ("linear" in entry.payload):
        raise ValueError("the entry is not of this block's kind")
    if "linear" in entry.payload:
        return _linear_entry(entry.payload["linear"])
    d, a = entry.payload.get("scales"), entry.arrays
    try:
        r = GroupReorder(*(torch.tensor(a[k], dtype=t) for k, t in zip(_GROUPS, _GROUP_DTYPES)))
        s = Q2Scales(**{k: float(d[k]) for k in _FLOATS}, **{k: torch.tensor(a[k], dtype=torch.float32) for k in _TABLES},
                     reorder=r)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"bad entry ({type(e).__name__}: {e})") from None
    if r.channel_index.ndim != 1 or sorted(r.channel_index.tolist()) != list(range(dims.d_inner)) or \
            r.head_index.ndim != 1 or sorted(r.head_index.tolist()) != list(range(dims.nheads)):
        raise ValueError("the channel or head order is not a permutation of the model's")
    if r.head_groups.ndim != 2 or r.head_groups.shape[0] != dims.ngroups or r.dim_groups.shape[:2] != r.head_groups.shape \
            or not bool((r.head_groups.sum(-1) == dims.nheads // dims.ngroups).all()) or \
            not bool((r.dim_groups.sum(-1) == dims.headdim).all()) or s.x_table.shape != r.dim_groups.shape or \
            s.B_scales.shape != (dims.ngroups,) or s.C_scales.shape != (dims.ngroups,) or \
            s.ssm_state_scale.shape != (*r.dim_groups.shape, dims.d_state):
        raise ValueError("the group tables do not fit the model")
    if bad := _bad(s):
        raise ValueError(f"scales that are not finite and positive: {', '.join(bad)}")
    return s


def _linear_entry(table) -> LinearScales:
    try:
        s = LinearScales(**{k: None if v is None else float(v) for k, v in table.items()})
    except (AttributeError, TypeError, ValueError) as e:
        raise ValueError(f"bad entry ({type(e).__name__}: {e})") from None
    if bad := _bad(s):
        raise ValueError(f"scales that are not finite and positive: {', '.join(bad)}")
    return s


def _bad(s) -> list[str]:
    if not isinstance(s, Q2Scales):  # a hybrid's attention or MLP block: its linears' scales (q2.linear)
        return [f"{k}={v}" for k, v in s.floats() if not (math.isfinite(v) and v > 0)]
    flat = [(k, getattr(s, k)) for k in _FLOATS] + [(k, x) for k in _TABLES for x in getattr(s, k).flatten().tolist()]
    return [f"{k}={v}" for k, v in flat if not (math.isfinite(v) and v > 0)]


def calibrate_quamba2(bank: WeightBank, windows: torch.Tensor, settings: CalibrationSettings, depth: int,
                      prefix_hashes: list[str], cache_dir: Path | None, *,
                      progress: Progress | None = None) -> CalibrationResult:
    """Q2Scales of blocks 0..depth, from the cache when every layer's entry is valid, else computed (and cached);
    computed scales that are not finite and positive are a ValueError naming them, never cached."""
    keys = layer_keys(prefix_hashes[: depth + 1], windows, settings, f"quamba2-v{Q2_CALIB_VERSION}")
    cache = _cache(cache_dir)
    info = {"prep": "quamba2", "settings": asdict(settings), "tokens": int(windows.numel()), "keys": keys,
            "observers": "min-max per tensor; cross-head min-max of x; per-SSD-group min-max of B, C "
                         "(Quamba c474646 quamba/modelutils_mamba.py:236-372); s_x_tensor: per-tensor percentile "
                         "of x, alpha --percentile_alpha (the non-grouped path's, :125-132, 161-167)"}
    scales, problems = cache.read_layers(keys, lambda layer, entry: _from_entry(entry, bank.dims, layer), "cache file")
    if cache.enabled and len(scales) == depth + 1:
        return CalibrationResult(scales, {**info, "source": "reused", "cache_files": [str(cache.path(k)) for k in keys],
                                          "seconds": 0.0, "layers": [s.info() for s in scales]})
    for problem in problems:
        warn(f"{problem}; recomputing the calibration")
    start = time.perf_counter()
    progress = Progress() if progress is None else progress
    batches = -(-windows.shape[0] // settings.batch_size)
    embed = lambda ids: bank.embed(ids, True, torch.float16, "exact", "fp16")  # noqa: E731
    with progress.stage(f"calibrating (prep=quamba2, {windows.shape[0]} x {windows.shape[1]} tokens, "
                        f"layers 0..{depth}, two passes)", 2 * batches, "batches",
                        estimate_seconds(int(windows.numel()), depth + 1, bank.dims, passes=2)):
        scales = calibrate_q2(bank.dims, bank.raw, embed, windows, depth, settings.batch_size, Q2_CALIBRATION_RECIPE,
                              step=progress.advance, alpha=settings.alpha)
    for i, s in enumerate(scales):
        if bad := _bad(s):
            raise ValueError(f"Quamba2 calibration gave scales that are not finite and positive in layer {i}: "
                             f"{', '.join(bad)}; nothing was cached")
    info.update(source="recomputed" if problems else "computed", seconds=round(time.perf_counter() - start, 3),
                layers=[s.info() for s in scales])
    if problems:
        info["reason"] = "; ".join(problems)
    if cache.enabled:
        try:
            info["cache_files"] = cache.write_layers(keys, [_entry(layer, s, settings) for layer, s in enumerate(scales)])
        except OSError as e:
            warn(f"cannot write the calibration cache in {cache_dir} ({e.strerror}); the scales of this run are not cached")
            info["cache_error"] = str(e)
    return CalibrationResult(scales, info)
