"""The main job: load once, calibrate once, run every mode up to the deepest captured layer, save.

Everything that can be checked before work starts (modes, taps, layers, output
path, model directory, tokenizer, sample length, calibration size) is checked
first and raises an ``InputError`` subclass; a mode that fails later is recorded
as an error and the other modes are kept.
"""
from __future__ import annotations

import hashlib
import os
import platform
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from . import __version__
from .build import build_backbone, hadamard_kernel_support
from .calibration import CalibrationResult, CalibrationSettings, calibrate
from .capture import RESIDUAL_BASIS, TapError, capture, parse_point, select_points
from .compare import compare_modes, same_basis
from .data import DEFAULT_CALIB_FILE, DEFAULT_TEXT_FILE, DataError, calibration_windows, read_sample
from .loading import ModelDirError, load_tokenizer, open_checkpoint
from .metrics import tensor_stats
from .modes import ModeError, ModeRecipe, resolve_modes
from .ops.hadamard import hadamard_transform
from .report import mode_summary, short_comparison
from .storage import SCHEMA_VERSION, StorageError, array_key, check_writable, dedup_arrays, load_capture, \
    parse_array_key, read_json, stats_path, tensor_name, write_json, write_npz
from .weights import WeightBank

__all__ = ["RunConfig", "RunOutcome", "RunError", "InputError", "run", "DEFAULT_MODEL"]

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "models" / "mamba-tiny"
# Tensors whose values depend on the residual-stream basis (compared only between equal bases).
_BASIS_POINTS = RESIDUAL_BASIS + ("norm.out", "out_proj.out", "had.out")


class RunError(ValueError):
    """Invalid run configuration (e.g. --resume against a different run)."""


InputError = (RunError, ModeError, TapError, ModelDirError, DataError, StorageError)


@dataclass
class RunConfig:
    model: Path = DEFAULT_MODEL
    tokenizer: Path | None = None
    modes: list[str] = field(default_factory=lambda: ["all"])
    modes_file: Path | None = None
    output_file: Path = Path("first_layer_io_all_modes.npz")
    seq_len: int = 512
    text_file: Path = DEFAULT_TEXT_FILE
    calib: CalibrationSettings = field(default_factory=CalibrationSettings)
    calib_file: Path = DEFAULT_CALIB_FILE
    cache_dir: Path | None = None
    layers: list[int] = field(default_factory=lambda: [0])
    taps: list[str] = field(default_factory=list)
    basis: str = "original"
    stats_only: bool = False
    resume: bool = False
    compress: bool = False
    dedup: bool = True
    reference: str = "fp32"
    argv: list[str] = field(default_factory=list)


@dataclass
class RunOutcome:
    stats: dict                                   # the _stats.json content
    by_mode: dict[str, dict[str, np.ndarray]]     # mode -> tensor -> array (before dedup; also with --stats-only)
    failed: list[str]
    token_ids: np.ndarray                         # (1, seq_len) int64


def _timestamp() -> str:
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    when = datetime.fromtimestamp(int(epoch), timezone.utc) if epoch else datetime.now(timezone.utc)
    return when.isoformat(timespec="seconds")


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def _basis_of(recipe: ModeRecipe, point: str, basis: str) -> str | None:
    if point not in _BASIS_POINTS:
        return None
    if recipe.rotate == "no":
        return "original"
    return basis if point in RESIDUAL_BASIS else "rotated"


def _run_mode(recipe: ModeRecipe, bank: WeightBank, calibs: dict[str, CalibrationResult | Exception],
              ids: torch.Tensor, points: list[str], depth: int, basis: str) -> tuple[dict, dict]:
    """Run one mode; returns (arrays by tensor name, stats entry). Raises on failure."""
    calib = calibs.get(recipe.prep)
    if recipe.needs_calibration and isinstance(calib, Exception):
        raise RuntimeError(f"calibration failed: {calib}")
    scales = calib.scales if isinstance(calib, CalibrationResult) and recipe.needs_calibration else None
    model = build_backbone(recipe, bank, scales, depth)
    with capture(model, points) as captured:
        model(ids)
    arrays, tensors = {}, {}
    for point in points:
        if point not in captured:
            continue  # a site the recipe does not have (had.out without rotation)
        cap = captured[point]
        site = parse_point(point)[1]
        values = cap.values
        if recipe.rotate == "yes" and basis == "original" and site in RESIDUAL_BASIS:
            values = hadamard_transform(values, transpose=True).to(torch.float32)
        name = tensor_name(point)
        arrays[name] = values.numpy()
        tensors[name] = {"point": point, "basis": _basis_of(recipe, site, basis),
                         **tensor_stats(arrays[name], None if cap.codes is None else cap.codes.numpy(), cap.scale,
                                        cap.n_clipped)}
    return arrays, tensors


def _provenance(cfg: RunConfig, ckpt, tok, text, ids, prefix: list[str], depth: int, points: list[str]) -> dict:
    return {
        "harness_version": __version__, "python": platform.python_version(), "torch": torch.__version__,
        "transformers": _version("transformers"), "numpy": np.__version__, "platform": platform.platform(),
        "device": "cpu", "torch_threads": torch.get_num_threads(),
        "model": {"path": str(ckpt.path), "format": ckpt.format, "dims": asdict(ckpt.dims),
                  "stored_dtype": ckpt.stored_dtype(), "hash": prefix[depth],
                  "hash_scope": f"sha256 over dims, embedding and blocks 0..{depth} (deeper blocks are never read)"},
        "tokenizer": {"path": str(tok.path), "sha256": hashlib.sha256(Path(tok.path).read_bytes()).hexdigest(),
                      "eos_id": tok.eos_id},
        "sample": {"text_file": str(text.path), "sha256": text.sha256, "documents": text.n_documents,
                   "documents_used": text.documents_used, "tokens": int(ids.shape[1]), "token_ids_sha256": hashlib.sha256(ids.numpy().tobytes()).hexdigest()},
        "seed": cfg.calib.seed, "basis": cfg.basis, "layers": cfg.layers, "taps": cfg.taps, "points": points,
    }


def _previous(cfg: RunConfig, provenance: dict, calib_text, recipes: list[ModeRecipe]) -> tuple[dict, dict]:
    """(arrays by key, mode stats) of the modes that already succeeded in the file being resumed
    with the same recipe (a mode recorded with other knobs, e.g. before `prep` existed, is run again)."""
    knobs = {r.name: r.knobs() for r in recipes}
    spath = stats_path(cfg.output_file)
    if not (Path(cfg.output_file).is_file() and spath.is_file()):
        return {}, {}
    old = read_json(spath)
    old_prov = old.get("provenance", {})
    for what, new, was in (("model", provenance["model"]["hash"], old_prov.get("model", {}).get("hash")),
                           ("token ids", provenance["sample"]["token_ids_sha256"], old_prov.get("sample", {}).get("token_ids_sha256")),
                           ("capture points", provenance["points"], old_prov.get("points")),
                           ("basis", provenance["basis"], old_prov.get("basis"))):
        if new != was:
            raise RunError(f"--resume: {cfg.output_file} was made with a different {what}; "
                           f"use another --output_file or drop --resume")
    old_calib = old_prov.get("calibration") or {}
    if calib_text is not None and "settings" in old_calib and (
            old_calib["settings"] != asdict(cfg.calib) or old_calib.get("calib_file_sha256") != calib_text.sha256):
        raise RunError(f"--resume: {cfg.output_file} was calibrated with other settings or text; "
                       f"use another --output_file or drop --resume")
    cf = load_capture(Path(cfg.output_file))
    arrays, modes = {}, {}
    for mode, entry in old.get("modes", {}).items():
        if entry.get("status") == "ok" and mode in cf.index and entry.get("recipe") == knobs.get(mode):
            modes[mode] = entry
            for tensor in cf.tensors(mode):
                arrays[array_key(mode, tensor)] = np.array(cf.array(mode, tensor))
    return arrays, modes


def run(cfg: RunConfig, emit: Callable[[str], None] = print) -> RunOutcome:
    recipes = resolve_modes(cfg.modes, cfg.modes_file)
    if cfg.basis not in ("original", "rotated"):
        raise RunError(f"unknown basis {cfg.basis!r}; valid: original, rotated")
    if not cfg.layers or min(cfg.layers) < 0:
        raise RunError(f"--layers must be non-negative block indices, got {cfg.layers}")
    points = select_points(sorted(set(cfg.layers)), cfg.taps)
    depth = max(parse_point(p)[0] for p in points)
    check_writable(Path(cfg.output_file))
    check_writable(stats_path(cfg.output_file))
    ckpt = open_checkpoint(cfg.model)
    if depth >= ckpt.dims.n_layer:
        raise RunError(f"layer {depth} was requested, but {cfg.model} has {ckpt.dims.n_layer} blocks "
                       f"(valid: 0..{ckpt.dims.n_layer - 1})")
    tok = load_tokenizer(cfg.model, cfg.tokenizer)
    with ThreadPoolExecutor(max_workers=1) as pool:  # hashing (GIL released) overlaps with tokenizing
        hashing = pool.submit(ckpt.prefix_hashes, depth)
        text = read_sample(tok, cfg.text_file, cfg.seq_len)
        calib_text = calibration_windows(tok, cfg.calib_file, cfg.calib.num_samples, cfg.calib.seqlen,
                                         cfg.calib.seed) if any(r.needs_calibration for r in recipes) else None
        prefix = hashing.result()
    ids = text.ids
    provenance = _provenance(cfg, ckpt, tok, text, ids, prefix, depth, points)
    kept_arrays, kept_modes = _previous(cfg, provenance, calib_text, recipes) if cfg.resume else ({}, {})
    todo = [r for r in recipes if r.name not in kept_modes]
    bank = WeightBank(ckpt)
    support = hadamard_kernel_support(recipes, ckpt.dims)
    if support is not None:
        provenance["hadamard_kernel_support"] = support
        for width, reason in support.items():
            if reason is not None:
                print(f"warning: {width} = {getattr(ckpt.dims, width)}: Quamba's Hadamard kernels do not support "
                      f"this width ({reason}); the harness rotates it anyway", file=sys.stderr)
    # one calibration per prep (its calibration model and cache key differ), in the order modes need them
    preps = list(dict.fromkeys(r.prep for r in todo if r.needs_calibration))
    calibs = {prep: _calibrate(cfg, calib_text, bank, prefix, depth, emit, prep) for prep in preps}
    infos = {prep: c.info if isinstance(c, CalibrationResult) else {"prep": prep, "error": str(c)}
             for prep, c in calibs.items()}
    provenance["calibration"] = infos[preps[0]] if preps else None
    provenance["calibration_by_prep"] = infos

    arrays_by_mode: dict[str, dict[str, np.ndarray]] = {}
    modes: dict[str, dict] = {}
    for recipe in recipes:
        if recipe.name in kept_modes:
            modes[recipe.name] = {**kept_modes[recipe.name], "resumed": True}
            arrays_by_mode[recipe.name] = {parse_array_key(k)[1]: v for k, v in kept_arrays.items()
                                           if parse_array_key(k)[0] == recipe.name}
            emit(f"mode {recipe.name}: kept from {cfg.output_file} (--resume)")
            continue
        start = time.perf_counter()
        base = {"title": recipe.title, "recipe": recipe.knobs()}
        try:
            arrays, tensors = _run_mode(recipe, bank, calibs, ids, points, depth, cfg.basis)
            modes[recipe.name] = {"status": "ok", **base, "seconds": round(time.perf_counter() - start, 3),
                                  "tensors": tensors}
            arrays_by_mode[recipe.name] = arrays
        except Exception as e:  # a failing mode is recorded, the others go on
            modes[recipe.name] = {"status": "error", **base, "error": f"{type(e).__name__}: {e}",
                                  "traceback": traceback.format_exc()}
            print(f"error: mode {recipe.name} failed: {type(e).__name__}: {e}", file=sys.stderr)
        emit(mode_summary(recipe.name, modes[recipe.name], [tensor_name(p) for p in points if "block." in p]))
    _check_quantized_differ(recipes, modes, arrays_by_mode, cfg.reference)
    provenance["model"]["tensors_read"] = ckpt.read_summary()
    return _finish(cfg, recipes, modes, arrays_by_mode, provenance, ids, emit)


def _calibrate(cfg: RunConfig, calib_text, bank: WeightBank, prefix: list[str], depth: int, emit, prep: str):
    try:
        result = calibrate(bank, calib_text.ids, cfg.calib, depth, prefix, cfg.cache_dir, prep)
    except Exception as e:  # the quantized modes fail with this error, float modes still run
        print(f"error: calibration failed: {type(e).__name__}: {e}", file=sys.stderr)
        return e
    result.info.update(calib_file=str(calib_text.path), calib_file_sha256=calib_text.sha256,
                       calib_documents_used=calib_text.documents_used)
    emit(f"calibration (prep={prep}): {result.info['source']} ({cfg.calib.num_samples} samples x {cfg.calib.seqlen} tokens, "
         f"alpha {cfg.calib.alpha}, layers 0..{depth}, {result.info['seconds']} s)")
    return result


def _check_quantized_differ(recipes, modes, arrays_by_mode, reference: str) -> None:
    """MODES.md contract 9: a mode that quantizes must not reproduce the float reference bit for bit."""
    ref = arrays_by_mode.get(reference)
    ref_recipe = next((r for r in recipes if r.name == reference), None)
    if ref is None or ref_recipe is None or ref_recipe.needs_calibration:
        return
    for recipe in recipes:
        arrays = arrays_by_mode.get(recipe.name)
        if recipe.name == reference or not recipe.needs_calibration or arrays is None or "resumed" in modes[recipe.name]:
            continue
        outputs = [t for t in arrays if t == "output" or t.endswith(".block.out")]
        if outputs and all(t in ref and np.array_equal(ref[t], arrays[t]) for t in outputs):
            modes[recipe.name].update(status="error", error=(
                f"the output is bit-identical to {reference} although the recipe quantizes: "
                "the quantization did not take effect"))
            arrays_by_mode.pop(recipe.name)


def _finish(cfg, recipes, modes, arrays_by_mode, provenance, ids, emit) -> RunOutcome:
    failed = [r.name for r in recipes if modes[r.name]["status"] != "ok"]
    comparison = None
    if cfg.reference in arrays_by_mode:
        tensors = {m: list(a) for m, a in arrays_by_mode.items()}

        comparable = same_basis(lambda m, t: modes[m]["tensors"].get(t, {}).get("basis"), cfg.reference)
        comparison = compare_modes(tensors, lambda m, t: arrays_by_mode[m][t], cfg.reference, comparable)
        block_io = [t for t in arrays_by_mode[cfg.reference] if t in ("input", "output", "residual") or ".block." in t]
        emit(short_comparison(comparison, block_io))
    else:
        emit(f"\nno comparison: reference mode {cfg.reference!r} was not run or failed")
    model_path = Path(cfg.model)
    arrays: dict[str, np.ndarray] = {"token_ids": ids.numpy().astype(np.int64),
                                     "timestamp": np.array(_timestamp()), "model": np.array(model_path.name),
                                     "pretrained_dir": np.array(str(model_path.parent)), "seq_len": np.array(cfg.seq_len)}
    if not cfg.stats_only:
        for mode, by_tensor in arrays_by_mode.items():
            arrays.update({array_key(mode, t): v for t, v in by_tensor.items()})
    aliases = {}
    if cfg.dedup:
        arrays, aliases = dedup_arrays(arrays)
    stats = {"schema_version": SCHEMA_VERSION, "timestamp": str(arrays["timestamp"]), "model": model_path.name,
             "pretrained_dir": str(model_path.parent), "seq_len": cfg.seq_len, "command": cfg.argv,
             "stats_only": cfg.stats_only, "provenance": provenance, "modes": modes, "aliases": aliases,
             "comparison": comparison, "failed_modes": failed}
    write_npz(Path(cfg.output_file), arrays, cfg.compress)
    write_json(stats_path(cfg.output_file), stats)
    emit(f"\nwrote {cfg.output_file} and {stats_path(cfg.output_file)}"
         + (f"; failed modes: {', '.join(failed)}" if failed else ""))
    return RunOutcome(stats, arrays_by_mode, failed, ids.numpy())
