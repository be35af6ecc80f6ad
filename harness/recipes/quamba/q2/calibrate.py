"""Quamba2's W8A8 calibration of a Mamba-2 model (prep=quamba2; emulation.q2_calibration), cached on disk.

Every scale table and group range is recorded in the provenance ("calibration_by_prep" -> "quamba2" -> "layers").
The cache works as the Mamba-1 one (runner.calibration): one file per layer, under a key chaining the model up to
that layer, the calibration tokens, the settings and "quamba2"; a file that fails its checksum, does not parse, or
holds scales that are not finite and positive or groups that do not fit the model is reported and recomputed.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from .grouping import GroupReorder
from .calibration import calibrate_q2
from .params import Q2Scales
from ....modes import Q2_CALIBRATION_RECIPE
from ....runtime.guard import Progress
from ....runtime.log import warn
from ....store.files import read_regular
from ....runner.calibration import CalibrationResult, CalibrationSettings, checksum, layer_keys
from ....runner.weightbank import WeightBank

__all__ = ["calibrate_quamba2", "read_layer_cache", "Q2_CALIB_VERSION"]

Q2_CALIB_VERSION = 4  # bump when anything that changes the computed scales or groups changes (2: s_x_tensor;
                      # 3: ssm_state_scale; 4: the fp16 model's A_log in fp16)
_FORMAT = "quamba-harness-calibration-q2"
_FLOATS = ("s_in", "s_z", "s_x", "s_B", "s_C", "s_dt", "s_H", "s_x_tensor")
_TABLES = ("x_table", "B_scales", "C_scales", "ssm_state_scale")
_GROUPS = ("channel_index", "head_index", "head_groups", "dim_groups")


def _to_json(s: Q2Scales) -> dict:
    out = {k: getattr(s, k) for k in _FLOATS}
    out.update({k: getattr(s, k).tolist() for k in _TABLES})
    out.update({k: getattr(s.reorder, k).tolist() for k in _GROUPS})
    return out


def _from_json(d: dict, dims) -> Q2Scales:
    """ValueError naming what does not fit the model."""
    try:
        r = GroupReorder(torch.tensor(d["channel_index"], dtype=torch.int64), torch.tensor(d["head_index"], dtype=torch.int64),
                         torch.tensor(d["head_groups"], dtype=torch.int32), torch.tensor(d["dim_groups"], dtype=torch.int32))
        s = Q2Scales(**{k: float(d[k]) for k in _FLOATS}, **{k: torch.tensor(d[k], dtype=torch.float32) for k in _TABLES},
                     reorder=r)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"bad entry ({type(e).__name__}: {e})") from None
    if sorted(r.channel_index.tolist()) != list(range(dims.d_inner)) or sorted(r.head_index.tolist()) != list(range(dims.nheads)):
        raise ValueError("the channel or head order is not a permutation of the model's")
    if r.head_groups.shape[0] != dims.ngroups or r.dim_groups.shape[:2] != r.head_groups.shape or \
            not bool((r.head_groups.sum(-1) == dims.nheads // dims.ngroups).all()) or \
            not bool((r.dim_groups.sum(-1) == dims.headdim).all()) or s.x_table.shape != r.dim_groups.shape or \
            s.B_scales.shape != (dims.ngroups,) or s.C_scales.shape != (dims.ngroups,) or \
            s.ssm_state_scale.shape != (*r.dim_groups.shape, dims.d_state):
        raise ValueError("the group tables do not fit the model")
    if bad := _bad(s):
        raise ValueError(f"scales that are not finite and positive: {', '.join(bad)}")
    return s


def _bad(s: Q2Scales) -> list[str]:
    flat = [(k, getattr(s, k)) for k in _FLOATS] + [(k, x) for k in _TABLES for x in getattr(s, k).flatten().tolist()]
    return [f"{k}={v}" for k, v in flat if not (math.isfinite(v) and v > 0)]


def _read(path: Path, key: str, dims) -> Q2Scales:
    try:
        data = json.loads(read_regular(path, 1 << 24, lambda what: ValueError(f"it is {what}")))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"unreadable ({type(e).__name__})") from None
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        raise ValueError("not a Quamba2 calibration cache file")
    if data.get("checksum") != checksum({k: v for k, v in data.items() if k != "checksum"}):
        raise ValueError("checksum mismatch (the file was modified or truncated)")
    if data.get("key") != key or not isinstance(data.get("scales"), dict):
        raise ValueError("key mismatch")
    return _from_json(data["scales"], dims)


def _write(path: Path, key: str, layer: int, s: Q2Scales, settings: CalibrationSettings) -> None:
    payload = {"format": _FORMAT, "version": Q2_CALIB_VERSION, "key": key, "layer": layer, "prep": "quamba2",
               "scales": _to_json(s), "settings": asdict(settings)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({**payload, "checksum": checksum(payload)}, sort_keys=True))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_layer_cache(paths: list[Path], read: Callable[[int, Path], object], what: str) -> tuple[list, list[str]]:
    """The cached entries of layers 0, 1, ... up to the first missing or corrupted file (read(layer, path) raises
    ValueError for a corrupted one), and the problems found (``what`` names the kind of file)."""
    got, problems = [], []
    for layer, path in enumerate(paths):
        if not path.exists():
            break
        try:
            got.append(read(layer, path))
        except ValueError as e:
            problems.append(f"layer {layer} {what} {path} is corrupted: {e}")
            break
    return got, problems


def calibrate_quamba2(bank: WeightBank, windows: torch.Tensor, settings: CalibrationSettings, depth: int,
                      prefix_hashes: list[str], cache_dir: Path | None, *,
                      progress: Progress | None = None) -> CalibrationResult:
    """Q2Scales of blocks 0..depth, from the cache when every layer's entry is valid, else computed (and cached);
    computed scales that are not finite and positive are a ValueError naming them, never cached."""
    keys = layer_keys(prefix_hashes[: depth + 1], windows, settings, f"quamba2-v{Q2_CALIB_VERSION}")
    paths = [Path(cache_dir) / f"calib-q2-{k[:40]}.json" for k in keys] if cache_dir is not None else []
    info = {"prep": "quamba2", "settings": asdict(settings), "tokens": int(windows.numel()), "keys": keys,
            "observers": "min-max per tensor; cross-head min-max of x; per-SSD-group min-max of B, C "
                         "(Quamba c474646 quamba/modelutils_mamba.py:236-372); s_x_tensor: per-tensor percentile "
                         "of x, alpha --percentile_alpha (the non-grouped path's, :125-132, 161-167)"}
    scales, problems = read_layer_cache(paths, lambda i, p: _read(p, keys[i], bank.dims), "cache file") \
        if paths else ([], [])
    if paths and len(scales) == depth + 1:
        return CalibrationResult(scales, {**info, "source": "reused", "cache_files": [str(p) for p in paths],
                                          "seconds": 0.0, "layers": [s.info() for s in scales]})
    for problem in problems:
        warn(f"{problem}; recomputing the calibration")
    start = time.perf_counter()
    progress = Progress() if progress is None else progress
    batches = -(-windows.shape[0] // settings.batch_size)
    embed = lambda ids: bank.embed(ids, True, torch.float16, "exact", "fp16")  # noqa: E731
    with progress.stage(f"calibrating (prep=quamba2, {windows.shape[0]} x {windows.shape[1]} tokens, "
                        f"layers 0..{depth}, two passes)", 2 * batches, "batches"):
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
    if paths:
        try:
            for layer, (path, key, s) in enumerate(zip(paths, keys, scales)):
                _write(path, key, layer, s, settings)
            info["cache_files"] = [str(p) for p in paths]
        except OSError as e:
            warn(f"cannot write the calibration cache in {cache_dir} ({e.strerror}); the scales of this run are not cached")
            info["cache_error"] = str(e)
    return CalibrationResult(scales, info)
