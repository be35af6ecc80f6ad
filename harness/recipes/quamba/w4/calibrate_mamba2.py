"""Quamba2's W4A8 / W4A16 calibration of a Mamba-2 model: Quamba's GPTQ on CPU (recipes.quamba.w4.gptq_mamba2), cached on disk.

Calibration keys (``ModeRecipe.calibration_key``): "quamba2-w4a8" is the W8A8 calibration (recipes.quamba.q2.calibrate,
its own cache) followed by GPTQ of the reordered model, as Quamba reorders and calibrates before GPTQ
(quamba/modelutils_mamba.py:801-833); "quamba2-w4a16" is GPTQ of the model as it is (no reorder, :820-825).

The cache: one entry per layer (runner.layercache, kind "gptq": the codes and scales of in_proj and out_proj as
arrays, "in_proj.codes", "in_proj.group_scales", "in_proj.channel_scales" (W4A8), ...), under a key chaining the
model up to that layer, the calibration tokens, the settings and the variant, so a layer's entry is only reused
with the GPTQ of every layer before it. An entry that the cache refuses or that does not fit the model is
reported and the GPTQ recomputed. On a hybrid (spec.HybridDims) the attention and MLP blocks are not quantized
(gptq_mamba2): their entries hold no arrays, only {"layer", "kind": "float"}, so the chain of keys still covers them.
"""
from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from ....emulation.gptq import PERCDAMP, gptq_group_size
from .block_mamba2 import Q2W4Layer
from ....kernels.int4 import Int4Weight
from .gptq_mamba2 import gptq_q2, q2w4_layers
from ..q2.params import reorder_raw
from ..q2.calibration import ssm_dims
from ....architectures.bamba.build import is_ssm_block
from ....modes import Q2_CALIBRATION_RECIPE
from ....runtime.guard import Progress
from ....runtime.log import warn
from ....runner.calibcost import estimate_seconds
from ....runner.calibration import CalibrationResult, CalibrationSettings, layer_keys
from ..q2.calibrate import calibrate_quamba2
from ....runner.layercache import Entry, LayerCache
from ....runner.weightbank import WeightBank

__all__ = ["calibrate_q2w4", "GPTQ_VERSION", "CACHE_KIND", "cached_gptq", "cached_layers", "gptq_cache", "gptq_info"]

GPTQ_VERSION = 2  # bump when anything that changes the GPTQ result changes (2: the fp16 model's A_log in fp16)
CACHE_KIND = "gptq"  # runner.layercache: one entry per layer, the arrays of _arrays
_PARTS = ("in_proj", "out_proj")


def _arrays(ws: tuple[Int4Weight, Int4Weight] | None) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    if ws is None:  # a hybrid's attention or MLP block
        return out
    for part, w in zip(_PARTS, ws):
        out[f"{part}.codes"] = w.codes.numpy()
        out[f"{part}.group_scales"] = w.group_scales.numpy()
        if w.channel_scales is not None:
            out[f"{part}.channel_scales"] = w.channel_scales.numpy()
    return out


def _shapes(dims) -> dict[str, tuple[int, int]]:
    dims = ssm_dims(dims)
    in_rows = 2 * dims.d_inner + (2 * dims.ngroups * dims.d_state + dims.nheads if dims.architecture == "mamba2" else 0)
    return {"in_proj": (in_rows, dims.d_model), "out_proj": (dims.d_model, dims.d_inner)}


def gptq_cache(cache_dir: Path | None, dims) -> LayerCache:
    """The GPTQ entries (runner.layercache, kind "gptq"): a layer's uint8 codes and scales, about one byte per
    weight; a file of more than twice that (and a MiB) is no entry of this model."""
    return LayerCache(cache_dir, CACHE_KIND, max_bytes=2 * sum(r * c for r, c in _shapes(dims).values()) + (1 << 20))


def _from_entry(entry: Entry, dims, channel: bool, layer: int) -> tuple[Int4Weight, Int4Weight] | None:
    """ValueError naming what does not fit the model (None: a hybrid's attention or MLP block's entry)."""
    arrays, shapes = entry.arrays, _shapes(dims)
    if (entry.payload.get("kind") == "float") == is_ssm_block(dims, layer) or \
            (not is_ssm_block(dims, layer) and arrays):
        raise ValueError("the entry is not of this block's kind")
    if not is_ssm_block(dims, layer):
        return None
    ws = []
    for part in _PARTS:
        try:
            codes = torch.from_numpy(arrays[f"{part}.codes"])
            gs = torch.from_numpy(arrays[f"{part}.group_scales"])
            ch = torch.from_numpy(arrays[f"{part}.channel_scales"]) if channel else None
            w = Int4Weight(codes, gs, ch, codes.shape[1] // max(gs.shape[1], 1))
        except (KeyError, ValueError, TypeError, RuntimeError, IndexError) as e:
            raise ValueError(f"bad {part} ({type(e).__name__}: {e})") from None
        rows, cols = shapes[part]
        if w.shape != (rows, cols) or \
                w.group_size != gptq_group_size(cols) or gs.dtype != torch.float16:
            raise ValueError(f"{part} does not fit the model (shape {w.shape}, group size {w.group_size})")
        ws.append(w)
    return ws[0], ws[1]


def calibrate_q2w4(bank: WeightBank, windows: torch.Tensor, settings: CalibrationSettings, depth: int,
                   prefix_hashes: list[str], cache_dir: Path | None, key: str, *,
                   progress: Progress | None = None) -> CalibrationResult:
    """Q2W4Layer of blocks 0..depth for key "quamba2-w4a8" or "quamba2-w4a16" (module docstring)."""
    channel = key == "quamba2-w4a8"
    progress = Progress() if progress is None else progress
    q2 = calibrate_quamba2(bank, windows, settings, depth, prefix_hashes, cache_dir, progress=progress) \
        if channel else None
    keys = layer_keys(prefix_hashes[: depth + 1], windows, settings, f"{key}-gptq-v{GPTQ_VERSION}")
    info = gptq_info(key, settings, windows, keys, bank.dims)
    if q2 is not None:
        info["w8a8"] = q2.info
    start = time.perf_counter()

    def compute(step) -> list[tuple[Int4Weight, Int4Weight]]:
        dims = bank.dims
        raws = [bank.raw(i) for i in range(depth + 1)]
        if q2 is not None:  # the Mamba-2 blocks reordered by their head/dim groups (a hybrid's others: LinearScales)
            raws = [reorder_raw(r, s.reorder, dims.d_inner, dims.nheads) if is_ssm_block(dims, i) else r
                    for i, (r, s) in enumerate(zip(raws, q2.scales))]
        embed = lambda ids: bank.embed(ids, True, torch.float16, "exact", "fp16")  # noqa: E731
        return gptq_q2(dims, raws, embed, windows, settings.batch_size, Q2_CALIBRATION_RECIPE, channel, step=step)

    weights = cached_gptq(gptq_cache(cache_dir, bank.dims), keys, bank.dims, channel, compute, info, progress,
                          title=f"GPTQ ({key}, {windows.shape[0]} x {windows.shape[1]} tokens, layers 0..{depth})",
                          depth=depth, tokens=windows.numel())
    layers: list[Q2W4Layer | None] = q2w4_layers(weights, q2.scales if q2 is not None else None, ssm_dims(bank.dims))
    info.update(seconds=round(time.perf_counter() - start, 3),
                layers=[{"float": "fp16"} if x is None else x.info() for x in layers])
    return CalibrationResult(layers, info)


# GPTQ's phase in calibration passes (runner.calibcost), by architecture: the windows through each layer in fp16 for
# in_proj's and out_proj's Hessians, then each weight solved column by column. Measured on the shipped models (32
# windows of 256 tokens, one layer, one torch thread, machine shared): Mamba-1 3.5 s, 2.2 times one calibration
# pass; Mamba-2 1.6 s, 1.0 times. Another architecture takes the larger.
GPTQ_PASSES = {"mamba1": 2.2, "mamba2": 1.0}


def gptq_info(key: str, settings: CalibrationSettings, windows: torch.Tensor, keys: list[str], dims) -> dict:
    """The calibration record of a GPTQ run (the provenance's calibration_by_prep entry)."""
    dims = ssm_dims(dims)
    return {"prep": key, "settings": asdict(settings), "tokens": int(windows.numel()), "keys": keys,
            "gptq": {"percdamp": PERCDAMP, "group_size": {"in_proj": gptq_group_size(dims.d_model),
                                                          "out_proj": gptq_group_size(dims.d_inner)},
                     "order": "columns in order (no act_order), block = group", "dtype": "float32",
                     "source": "Quamba c474646 quamba/gptq_utils.py:105-189, modelutils_mamba.py:388-476"}}


def cached_layers(cache: LayerCache, keys: list[str], read, write, compute, info: dict, progress: Progress, *,
                  title: str, estimate: float) -> list:
    """Every layer's value from the cache's entries under `keys` (read(i, entry)) when all are valid, else
    compute(step), written back as write(i, value) = (payload, arrays) (an entry that is not valid is reported and
    recomputed), its phase shown with `estimate` seconds. info gets source, reason, cache_files."""
    got, problems = cache.read_layers(keys, read, "GPTQ cache file")
    if cache.enabled and len(got) == len(keys):
        info.update(source="reused", cache_files=[str(cache.path(k)) for k in keys])
        return got
    for problem in problems:
        warn(f"{problem}; recomputing GPTQ")
    with progress.stage(title, len(keys), "layers", estimate):
        values = compute(progress.advance)
    info["source"] = "recomputed" if problems else "computed"
    if problems:
        info["reason"] = "; ".join(problems)
    if cache.enabled:
        try:
            cache.write_layers(keys, [write(i, v) for i, v in enumerate(values)])
        except OSError as e:
            warn(f"cannot write the GPTQ cache in {cache.cache_dir} ({e.strerror}); the GPTQ of this run is not cached")
            info["cache_error"] = str(e)
        info["cache_files"] = [str(cache.path(k)) for k in keys]
    return values


def cached_gptq(cache: LayerCache, keys: list[str], dims, channel: bool, compute, info: dict, progress: Progress, *,
                title: str, depth: int, tokens: int) -> list[tuple[Int4Weight, Int4Weight]]:
    """Every layer's (in_proj, out_proj) through cached_layers (keys: one per block 0..depth; an attention or MLP
    block's entry holds no arrays, only {"layer", "kind": "float"}), its phase estimated for `tokens` tokens
    (runner.calibcost)."""
    estimate = estimate_seconds(tokens, depth + 1, dims, GPTQ_PASSES.get(dims.architecture, max(GPTQ_PASSES.values())))
    return cached_layers(cache, keys, lambda i, entry: _from_entry(entry, dims, channel, i),
                         lambda layer, ws: ({"layer": layer, **({"kind": "float"} if ws is None else {})}, _arrays(ws)),
                         compute, info, progress, title=title, estimate=estimate)
