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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..runtime.log import error, warn
from .. import __version__
from ..emulation.build import hadamard_kernel_support
from .calibration import CalibrationResult
from .collect import Collector, block_io_names
from .config import DEFAULT_MODEL, RunConfig, RunError, RunOutcome
from .context import RunContext
from .decodeplan import check_decode, generated_text, read_text, state_scales
from .dispatch import open_units
from ..architectures.registry import architecture_names
from ..emulation.capture import (ISOLATED, TapError, parse_array_key, parse_point, point_name, points_of, resolve_layers,
                                 select_points)
from ..checkpoints.text import (
    DataError,
    calibration_windows,
    check_token_ids,
)
from ..checkpoints.loading import ModelDirError
from ..modes import ModeError, ModeRecipe, Prep
from ..plugins import PluginError, canonical, load_all
from ..recipes.registry import Recipe, recipe_for, resolve_modes
from .pairing import check_pair, checkpoint_calibration, needs_float, open_models
from ..report.target import check_target, report_path
from ..report.text import generation_table, sample_mean_table, sensitivity_tables, short_comparison
from .studies import run_studies
from .modeloop import run_todo
from .resume import ResumeError, kept_calibration, previous_modes, recorded_recipe
from ..runtime.guard import LockError, OutputLock, Progress, fault_point
from ..runtime.machine import cpu_provenance
from ..store.format import (
    SCHEMA_VERSION,
    PairWriter,
    StorageError,
    check_output,
    check_writable,
    file_sha256,
    pending_path,
    stats_path,
)
from .weightbank import WeightBank

__all__ = ["RunConfig", "RunOutcome", "RunError", "InputError", "run", "DEFAULT_MODEL"]  # the first three: runner.config

InputError = (RunError, ModeError, TapError, ModelDirError, DataError, StorageError, LockError, ResumeError,
              PluginError)


def _timestamp() -> str:
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    when = datetime.fromtimestamp(int(epoch), timezone.utc) if epoch else datetime.now(timezone.utc)
    return when.isoformat(timespec="seconds")


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def _provenance(cfg: RunConfig, ckpt, tok, text, ids, *, prefix: list[str], depth: int, points: list[str]) -> dict:
    return {
        "harness_version": __version__, "python": platform.python_version(), "torch": torch.__version__,
        "transformers": _version("transformers"), "numpy": np.__version__, "platform": platform.platform(),
        "device": cfg.device, "torch_threads": torch.get_num_threads(), "cpu": cpu_provenance(),
        "model": {"path": str(ckpt.path), "format": ckpt.format, "architecture": ckpt.dims.architecture,
                  "dims": asdict(ckpt.dims),
                  "stored_dtype": ckpt.stored_dtype(), "hash": prefix[depth],
                  "hash_scope": f"sha256 over dims, embedding and blocks 0..{depth} (deeper blocks are never read)"},
        "tokenizer": {"path": str(tok.path), "sha256": file_sha256(tok.path),
                      "eos_id": tok.eos_id},
        "sample": {"text_file": str(text.path), "sha256": text.sha256, "documents": text.n_documents,
                   "documents_used": text.documents_used, "tokens": int(ids.shape[1]), "samples": int(ids.shape[0]),
                   "windows": [[k * int(ids.shape[1]), (k + 1) * int(ids.shape[1])] for k in range(ids.shape[0])],
                   "token_ids_sha256": hashlib.sha256(ids.numpy().tobytes()).hexdigest()},
        "seed": cfg.calib.seed, "basis": cfg.basis, "layers": cfg.layers, "taps": cfg.taps, "points": points,
        **({"plugins": [canonical(s) for s in cfg.plugins]} if cfg.plugins else {}),
    }


def _input_files(cfg: RunConfig, models, tok) -> dict[str, Path | None]:
    """Every file the run reads, by what it is (an output may never be one of them)."""
    files: dict[str, Path | None] = {}
    for what, ckpt in (("the model", models.primary), ("the float model", models.float_ckpt)):
        if ckpt is None:
            continue
        model = Path(ckpt.path)
        files[f"{what}'s config.json"] = model / "config.json"
        for name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
            files[f"{what}'s {name}"] = model / name
        weight_files = ckpt.weight_files() if hasattr(ckpt, "weight_files") else {model / "pytorch_model.bin"}
        for n, f in enumerate(sorted({str(f) for f in weight_files})):
            files[f"a weight file of {what} (#{n})"] = Path(f)
    files["the tokenizer"] = Path(tok.path)
    files["the tokenizer's merges.txt"] = Path(tok.path).with_name("merges.txt")
    files.update({"the text file": cfg.text_file, "the calibration file": cfg.calib_file,
                  "the modes file": cfg.modes_file})
    return files


def run(cfg: RunConfig, emit: Callable[[str], None] = print, progress: Progress | None = None) -> RunOutcome:
    """Run the modes of `cfg` and write the pair. emit: where the tables go (print); progress: told what
    the run is doing and what is on disk, for a caller that reports an interruption; None (a library caller):
    one showing the long phases on stderr as the command line does (pass ``Progress()`` for silence)."""
    progress = Progress.on_stderr() if progress is None else progress
    progress.reset(Path(cfg.output_file))
    progress.phase = "checking the inputs"
    load_all(cfg.plugins)  # the installed entry points and --plugin: their modes resolve like the built-in ones
    recipes = resolve_modes(cfg.modes, cfg.modes_file, None)  # names only: the model's architecture is not known yet
    if cfg.rerun:
        if not cfg.resume:
            raise RunError("--rerun only applies with --resume (without it every mode is run anyway)")
        rerun = resolve_modes(cfg.rerun, cfg.modes_file, None)
        recipes += [r for r in rerun if r.name not in {x.name for x in recipes}]
    if cfg.reference_required and not cfg.resume and cfg.reference not in {r.name for r in recipes}:
        raise RunError(f"--reference {cfg.reference!r} is not one of this run's modes "
                       f"({', '.join(r.name for r in recipes)}); add it to --modes or choose one of them")
    if cfg.basis not in ("original", "rotated"):
        raise RunError(f"unknown basis {cfg.basis!r}; valid: original, rotated")
    if cfg.device not in ("cpu", "cuda"):
        raise RunError(f"unknown device {cfg.device!r}; valid: cpu, cuda")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise RunError("--device cuda was asked for, but torch sees no CUDA device here "
                       f"(torch {torch.__version__}); run with --device cpu")
    if cfg.resume and (cfg.samples > 1 or cfg.isolated or cfg.end_to_end or cfg.sensitivity):
        raise RunError("--resume does not combine with --samples > 1, --isolated, --end-to-end or --sensitivity "
                       "yet; write a new --output_file instead")
    if cfg.samples < 1:
        raise RunError(f"--samples must be a positive integer, got {cfg.samples}")
    check_decode(cfg)
    every_site = {p: w for a in architecture_names() for p, w in points_of(a).items()}
    select_points([0], cfg.taps, every_site)  # a tap no architecture has: an input error before anything is opened
    out = Path(cfg.output_file)
    for path in (out, stats_path(out), pending_path(out)):
        check_writable(path)
    if cfg.report:  # the report written after the run may replace no file it did not write: known before any work
        check_target(report_path(out), out)
    models = open_models(cfg.model, cfg.mamba_model_path)
    ckpt = models.primary
    if models.quamba is None and cfg.mamba_model_path is not None:
        warn(f"--mamba_model_path is ignored: {cfg.model} is a float model, every mode is built from it")
    # presets mean other modes on Mamba-2, and a mode that does not run on the model's architecture is refused
    recipes = resolve_modes(cfg.modes + list(cfg.rerun or []), cfg.modes_file, ckpt.dims.architecture)
    xt = [r.name for r in recipes if r.x_groups == "tensor"]
    if xt and getattr(models.quamba, "prep", None) == Prep.QUAMBA2:  # the given checkpoint's prep knob
        raise RunError(f"mode(s) {', '.join(xt)} (x_groups=tensor) need the per-tensor x scale that only a calibration "
                       f"from the float model observes, but {cfg.model} is a Quamba2 checkpoint (its x scales are the "
                       f"grouped table): run them with the float model as --model")
    n_layer = ckpt.dims.n_layer
    for r in recipes:  # a modes file's per-layer range past the last block would apply to nothing
        r.check_layers(n_layer)
        if (problem := recipe_for(r).model_problem(r, ckpt.dims)) is not None:  # refused before any work
            raise RunError(f"mode {r.name} cannot run on {cfg.model}: {problem}")
        if (cfg.decode or cfg.generate) and (problem := recipe_for(r).decode_problem(r)) is not None:
            raise RunError(f"--decode/--generate cannot run {problem}; run it without --decode and --generate")
        if (problem := recipe_for(r).calibration_problem(r, cfg.calib)) is not None:
            raise RunError(f"mode {r.name} cannot calibrate: {problem}")
    cfg.layers = resolve_layers(cfg.layers, n_layer)
    points = select_points(cfg.layers, cfg.taps, points_of(ckpt.dims.architecture))
    depth = max(parse_point(p)[0] for p in points)
    if depth >= n_layer:
        raise RunError(f"layer {depth} was requested, but {cfg.model} has {n_layer} blocks "
                       f"(valid: 0..{n_layer - 1})")
    if cfg.isolated:
        points += [point_name(i, ISOLATED) for i in sorted({parse_point(p)[0] for p in points})]
    if cfg.end_to_end or cfg.sensitivity or cfg.generate:  # the whole model runs: every block is read and calibrated
        depth = n_layer - 1
    float_less = [r.name for r in recipes if models.quamba and models.float_ckpt is None
                  and needs_float(r, models.quamba.prep, models.quamba)]
    if float_less:
        raise RunError(f"mode(s) {', '.join(float_less)} need the float model (float weights, no rotation or "
                       f"prep=exact), but {cfg.model} is a quantized Quamba checkpoint: pass --mamba_model_path DIR "
                       f"(the float model it was made from), or run only int8 modes (e.g. --modes quant_only)")
    tok = models.tokenizer(cfg.tokenizer)
    inputs = _input_files(cfg, models, tok)
    for path in (out, stats_path(out), pending_path(out)):
        check_output(path, inputs)
    if out.suffix != ".npz":  # the pair's names derive from it: X.npz and X_stats.json
        raise RunError(f"--output_file {out}: the capture file's name must end in .npz, e.g. "
                       f"{out.with_suffix('.npz') if out.suffix else out.with_name(out.name + '.npz')} "
                       f"(its stats go to <name>_stats.json)")
    with open_units(cfg, models, progress.note) as units, OutputLock(out):  # unit lines: progress, on stderr
        return _run_locked(cfg, recipes, points, depth, models, tok, emit=emit, progress=progress, units=units)


def _run_locked(cfg: RunConfig, recipes: list[ModeRecipe], points: list[str], depth: int, models, tok, *,
                emit: Callable[[str], None], progress: Progress, units=None) -> RunOutcome:
    ckpt = models.primary
    with progress.stage("reading the text"), ThreadPoolExecutor(max_workers=2) as pool:  # hashing and the pairing check (taken below) overlap tokenizing
        hashing = pool.submit(ckpt.prefix_hashes, depth)
        pairing = pool.submit(check_pair, models, depth) if models.quamba and models.float_ckpt else None
        text = read_text(tok, cfg)  # N disjoint windows, in order (with --decode: one, plus the steps' tokens)
        calib_text = calibration_windows(tok, cfg.calib_file, cfg.calib.num_samples, cfg.calib.seqlen, cfg.calib.seed) \
            if models.needs_calibration(recipes) else None
        prefix = hashing.result()
    all_ids = text.ids.reshape(cfg.samples, -1)  # (1, L + N) with --decode
    ids = all_ids[:, :cfg.seq_len]
    check_token_ids(all_ids, ckpt.dims.vocab_size, tok.path)
    if calib_text is not None:
        check_token_ids(calib_text.ids, ckpt.dims.vocab_size, tok.path)
    provenance = _provenance(cfg, ckpt, tok, text, all_ids, prefix=prefix, depth=depth, points=points)
    kept = previous_modes(cfg, provenance, calib_text) if cfg.resume else {}
    requested = {r.name for r in recipes}
    if cfg.reference_required and cfg.reference not in requested | set(kept):
        raise RunError(f"--reference {cfg.reference!r} is neither one of this run's modes nor in {cfg.output_file} "
                       f"({', '.join(sorted(requested | set(kept)))}); add it to --modes or choose one of them")
    rerun = {r.name for r in resolve_modes(cfg.rerun, cfg.modes_file)} if cfg.rerun else set()
    todo: list[ModeRecipe] = []
    for mode, k in kept.items():  # modes of the file that were not asked for but must be re-run
        if mode not in requested and k.entry.get("status") == "ok" and not k.complete:
            recipe = recorded_recipe(mode, k.entry)
            if recipe is not None:
                todo.append(recipe)
                warn(f"mode {mode} in {cfg.output_file} has incomplete arrays "
                     f"({', '.join(k.missing) or 'none stored'}); running it again")
    for recipe in recipes:
        k = kept.get(recipe.name)
        changed = k is not None and k.entry.get("recipe") != recipe.knobs()
        if k is None or recipe.name in rerun or k.entry.get("status") != "ok" or not k.complete or changed:
            todo.append(recipe)
        if changed and recipe.name not in rerun:
            warn(f"mode {recipe.name} in {cfg.output_file} was made with another recipe; "
                 f"running it again")
        elif k is not None and k.entry.get("status") == "ok" and not k.complete and recipe.name not in rerun:
            warn(f"mode {recipe.name} in {cfg.output_file} has incomplete arrays "
                 f"({', '.join(k.missing) or 'none stored'}); running it again")
    if calib_text is None and models.needs_calibration(todo):  # a kept mode re-run needs it
        calib_text = calibration_windows(tok, cfg.calib_file, cfg.calib.num_samples, cfg.calib.seqlen, cfg.calib.seed)
        check_token_ids(calib_text.ids, ckpt.dims.vocab_size, tok.path)
    bank = models.bank
    _hadamard_support(recipes, bank.dims, provenance)
    progress.phase = "calibrating"
    fault_point("before-calibration")
    if models.quamba is not None:
        provenance["model"]["quamba"] = models.quamba.info()
        if pairing is not None:
            provenance["model"]["pairing"] = models.pairing(depth, pairing)
    # one calibration per prep (its calibration model and cache key differ), in the order modes need them;
    # a Quamba checkpoint brings the scales of prep=quamba (no calibration)
    calibs, owners = {}, {}
    for r in todo:
        family = recipe_for(r)
        if (key := family.calibration_key(r)) is not None:
            owners.setdefault(key, family)
    for prep, family in owners.items():
        calibs[prep] = checkpoint_calibration(models.quamba, depth) if models.gives_scales(prep) else \
            _calibrate(cfg, calib_text, bank, prefix, depth, emit, family=family, prep=prep, progress=progress)
    if calib_text is not None:  # what a family observes once every calibration is done (Quamba2: lm_head's input)
        for family in dict.fromkeys(recipe_for(r) for r in todo):
            family.after_calibration(calibs, todo, bank, calib_text.ids, cfg.calib, cfg.cache_dir, progress)
    infos = {prep: c.info if isinstance(c, CalibrationResult) else {"prep": prep, "error": str(c)}
             for prep, c in calibs.items()}
    if kept:  # the kept modes' calibration stays on record (--resume checks it next time)
        for prep, info in kept_calibration(cfg).items():
            infos.setdefault(prep, {**info, "source": "kept from the resumed file"})
    provenance["calibration"] = next(iter(infos.values()), None)
    provenance["calibration_by_prep"] = infos
    if cfg.decode:  # the SSM state scale the W8A8 / W4A8 step re-quantizes at, per layer (W4A16: an fp16 state)
        for prep, c in calibs.items():
            if isinstance(c, CalibrationResult) and (s_h := state_scales(c.scales)) is not None:
                infos[prep]["s_h"] = s_h

    modes: dict[str, dict] = {}
    todo_names = {r.name for r in todo}
    timestamp, model_path = _timestamp(), Path(cfg.model)
    meta = {"token_ids": all_ids.numpy().astype(np.int64), "timestamp": np.array(timestamp), "model": np.array(model_path.name),
            "pretrained_dir": np.array(str(model_path.parent)), "seq_len": np.array(cfg.seq_len)}
    ctx = RunContext(cfg, bank, calibs, [ids[k:k + 1] for k in range(ids.shape[0])], points, depth, progress, emit,
                     decode_ids=all_ids if cfg.decode else None, units=units)
    with PairWriter(Path(cfg.output_file), cfg.compress, cfg.dedup, progress) as writer:  # streamed as modes finish
        for key, arr in meta.items():
            writer.add(key, arr)
        collector = Collector(None if cfg.stats_only else writer, cfg.reference, modes, recipes, cfg.keep_arrays,
                              Path(cfg.output_file).parent,
                              unstored=frozenset() if cfg.store_logits else frozenset({"logits"}))
        for mode, k in kept.items():  # file order first; modes run again take their place
            if mode not in todo_names:
                modes[mode] = {**k.entry, "resumed": True}
                if k.entry.get("status") == "ok" and not k.complete:  # cannot be re-run: never kept as ok
                    modes[mode].update(status="error", error=f"arrays incomplete in the resumed file "
                                       f"({', '.join(k.missing)}) and its recorded recipe is not valid")
                if k.arrays:
                    collector.add(mode, k.arrays)
                    collector.end(mode)
                emit(f"mode {mode}: kept from {cfg.output_file} (--resume)")
        loop = run_todo(ctx, todo, modes, collector)
        generated_text(modes, tok, cfg.reference)
        provenance["shared_ops"] = loop.shared_ops
        order = list(kept) + [r.name for r in todo if r.name not in kept]
        ordered = {m: modes[m] for m in order if m in modes}
        modes.clear()
        modes.update(ordered)
        comparison = collector.finish(order)
        provenance["model"]["tensors_read"] = ckpt.read_summary()
        if models.quamba is not None and models.float_ckpt is not None:
            provenance["model"]["float_model"] = {"path": str(models.float_ckpt.path),
                                                  "format": models.float_ckpt.format,
                                                  "tensors_read": models.float_ckpt.read_summary()}
        studies = run_studies(ctx, recipes, modes, loop)
        if units is not None:  # worker provenance: what ran where (not part of the bit-identity with a serial run)
            provenance["workers"] = units.summary()
        return _finish(ctx, writer, collector, all_ids, modes=modes, comparison=comparison, provenance=provenance,
                       studies=studies, timestamp=timestamp)


def _hadamard_support(recipes: list[ModeRecipe], dims, provenance: dict) -> None:
    """Warn once per rotated width that Quamba's Hadamard kernels do not transform (the harness still does)."""
    support = hadamard_kernel_support(recipes, dims)
    if support is None:
        return
    provenance["hadamard_kernel_support"] = support
    for width, reason in support.items():
        if reason is not None:
            warn(f"{width} = {getattr(dims, width)}: Quamba's Hadamard kernels do not support "
                 f"this width ({reason}); the harness rotates it anyway")


def _calibrate(cfg: RunConfig, calib_text, bank: WeightBank, prefix: list[str], depth: int, emit, *, family: Recipe,
               prep: str, progress: Progress | None = None):
    try:
        result = family.calibrate(prep, bank, calib_text.ids, cfg.calib, depth, prefix, cfg.cache_dir,
                                  progress=progress)
    except Exception as e:  # the quantized modes fail with this error, float modes still run
        error(f"calibration failed: {type(e).__name__}: {e}")
        return e
    result.info.update(calib_file=str(calib_text.path), calib_file_sha256=calib_text.sha256,
                       calib_documents_used=calib_text.documents_used)
    info = result.info  # a family's own: "source" and "seconds" where it says them
    emit(f"calibration (prep={prep}): {info.get('source', 'done')} ({cfg.calib.num_samples} samples x "
         f"{cfg.calib.seqlen} tokens, alpha {cfg.calib.alpha}, layers 0..{depth}, {info.get('seconds', '?')} s)")
    return result


def _no_comparison(cfg: RunConfig, ok_modes: list[str]) -> None:
    """The reference did not run: say which --reference would compare the modes that did."""
    if not ok_modes:
        hint = ""
    elif cfg.stats_only:  # no arrays to compare afterwards
        hint = f"; run again with --reference {ok_modes[0]} (a mode of this run) to get one"
    else:
        hint = (f"; compare the file against one of its modes: python -m harness compare {cfg.output_file} "
                f"--reference {ok_modes[0]} (or capture with --reference {ok_modes[0]})")
    warn(f"no comparison: reference mode {cfg.reference!r} was not run or failed{hint}")


def _keep_complete_pair(writer: PairWriter) -> None:
    """A mode whose arrays could not be written (disk full) must not let an incomplete pair replace one on disk:
    nothing is committed, the old pair stays as it was (docs/guarantees.md)."""
    out = writer.path
    if writer.storage_failure is None or not (out.exists() or stats_path(out).exists()):
        return
    key = writer.storage_failure.partition(":")[0]
    what = f"mode {parsed[0]} could not write its arrays" if (parsed := parse_array_key(key)) else \
        f"array {key} could not be written"
    raise StorageError(f"{what} ({writer.storage_failure}); nothing was committed: "
                       f"the existing pair {out} and {stats_path(out).name} was kept unchanged. Free disk space "
                       f"and run again, or write to another --output_file")


def _finish(ctx: RunContext, writer: PairWriter, collector: Collector, ids: torch.Tensor, *, modes: dict,
            comparison: dict | None, provenance: dict, studies: dict, timestamp: str) -> RunOutcome:
    cfg, emit = ctx.cfg, ctx.emit
    failed = [m for m in modes if modes[m]["status"] != "ok"]
    if comparison is None:
        _no_comparison(cfg, [m for m, e in modes.items() if e.get("status") == "ok"])
    elif "error" not in comparison:
        names = block_io_names(collector.ref_names)
        emit(short_comparison(comparison, names, cfg.samples))
        if studies.get("samples"):
            emit(sample_mean_table(studies["samples"], list(comparison["modes"]), names))
        if cfg.isolated or cfg.sensitivity:
            emit(sensitivity_tables(comparison, studies.get("sensitivity"), cfg.reference))
    if cfg.generate:
        emit(generation_table(modes, cfg.reference))
    model_path = Path(cfg.model)
    stats = {"schema_version": SCHEMA_VERSION, "timestamp": timestamp, "model": model_path.name,
             "pretrained_dir": str(model_path.parent), "seq_len": cfg.seq_len, "command": cfg.argv,
             "stats_only": cfg.stats_only, "provenance": provenance, "modes": modes, "aliases": writer.aliases,
             "comparison": comparison, "failed_modes": failed, **studies}
    if cfg.end_to_end:  # --no-logits: the end-to-end metrics are there, the logits arrays are not
        stats["logits_stored"] = cfg.store_logits and not cfg.stats_only
    ctx.progress.phase = "writing the files"
    _keep_complete_pair(writer)
    stats = writer.commit(stats)
    emit(f"\nwrote {cfg.output_file} and {stats_path(cfg.output_file)}"
         + ("; the logits were not stored (--no-logits)" if cfg.end_to_end and not cfg.store_logits else "")
         + (f"; failed modes: {', '.join(failed)}" if failed else "")
         + (f"; failed units: {', '.join(u['unit'] for u in studies['failed_units'])}"
            if studies.get("failed_units") else ""))
    return RunOutcome(stats, collector.by_mode, failed + [u["unit"] for u in studies.get("failed_units", [])],
                      ids.numpy())
