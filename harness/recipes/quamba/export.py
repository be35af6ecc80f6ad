"""``python -m harness export``: calibrate every layer of a float model and write a Quamba1 W8A8 checkpoint
(a Mamba-2 model: a Quamba2 W8A8 checkpoint, runner.export_q2).

The weights are prepared and quantized by the code the built-in int8 modes run
(``WeightBank.layer(i, "int8", True, "quamba")``, ``WeightBank.embed``), the scales come from the same
calibration (and cache) as a capture, and ``quamba_ckpt.write_quamba`` lays them out as
``QuambaLMHeadModel.save_pretrained`` does. So capturing from the export gives the arrays of
capturing from the float model, bit for bit, whatever the weight preparation is.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ...runner.calibration import CalibrationSettings
from .calibration import calibrate
from ...checkpoints.text import DEFAULT_CALIB_FILE, DataError, calibration_windows
from ...checkpoints.loading import ModelDirError, load_tokenizer, open_checkpoint, refuse_in
from ...runner.backbone import build_backbone
from ...runtime.guard import Progress
from ...modes import CALIBRATION_RECIPES
from ...emulation.modules import EmuRMSNorm
from .observers import MinMaxObserver
from ...kernels.quant import quantize_rows_signed_max_fp16, quantize_weight_fp16
from ...spec import FloatOut
from ..registry import Exporter, exporters, get_exporter
from .checkpoint import PAD_VOCAB, is_quamba_dir, pad_rows, write_quamba
from ...store.files import StorageError, is_regular
from ...runner.weightbank import WeightBank, lm_head_weight
from .q2.export import check_q2_export, export_q2_files
from .w4.export_mamba2 import check_q2w4_export, export_q2w4_files

__all__ = ["ExportConfig", "ExportError", "export", "TOKENIZER_FILES", "INPUT_ERRORS", "BUILTIN_EXPORTS"]

BUILTIN_EXPORTS = ("w8a8", "w4a8", "w4a16")  # --recipe: these, or a registered Exporter's name (a plugin's)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")


class ExportError(ValueError):
    """Bad export request (output directory not empty, quantized input model)."""


@dataclass
class ExportConfig:
    model: Path
    output_dir: Path
    tokenizer: Path | None = None
    calib: CalibrationSettings = field(default_factory=CalibrationSettings)
    calib_file: Path = DEFAULT_CALIB_FILE
    cache_dir: Path | None = None
    quantize_embedding: bool = False
    quantize_lm_head: bool = False
    recipe: str = "w8a8"  # Quamba2's recipes for a Mamba-2 model (export_q2.Q2_RECIPES); Mamba-1: also w4a8, w4a16



def _lm_head_input_scale(bank: WeightBank, windows: torch.Tensor, batch_size: int, depth: int,
                         step: Callable[[], None] = lambda: None) -> float:
    """Min-max scale of lm_head's input (modelutils_mamba.py:182-189): the final norm's fp16 output of the
    calibration model (weight 1: folded into lm_head) over the calibration windows."""
    model = build_backbone(CALIBRATION_RECIPES["quamba"], bank, None, depth, calibration=True)
    norm = EmuRMSNorm(None, bank.dims.norm_eps, FloatOut(torch.float16))
    observer = MinMaxObserver()
    for batch in windows.split(batch_size):
        observer.observe(norm(model(batch)))
        step()
    return observer.compute_scale()


def _config(dims, vocab: int, embedding_layer: str, lm_head_layer: str) -> dict:
    """mamba_ssm MambaConfig.__dict__ with Quamba's additions (modelutils_mamba.py:863-870)."""
    ssm = {"d_state": dims.d_state, "d_conv": dims.d_conv, "expand": dims.d_inner // dims.d_model}
    if dims.dt_rank != -(-dims.d_model // 16):
        ssm["dt_rank"] = dims.dt_rank
    ssm["layer"] = "W8A8QMamba"
    return {"d_model": dims.d_model, "d_intermediate": 0, "n_layer": dims.n_layer, "vocab_size": vocab,
            "ssm_cfg": ssm, "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True, "residual_in_fp32": True,
            "fused_add_norm": True, "pad_vocab_size_multiple": PAD_VOCAB, "tie_embeddings": False,
            "norm_cfg": {"norm": "QRMSNorm"}, "embedding_cfg": {"layer": embedding_layer},
            "lm_head_cfg": {"layer": lm_head_layer}}


def _check_output_dir(out: Path) -> None:
    """Before any work: the output must be a new path or an empty real directory (a link, even to an empty
    directory or to nothing, cannot be replaced by the finished directory: it failed after the calibration)."""
    if out.is_symlink():
        raise ExportError(f"--output_dir {out} is a symbolic link (to {os.readlink(out)}); nothing is written "
                          f"through links, name a new directory")
    parent = next((p for p in out.parents if p.exists() or p.is_symlink()), Path.cwd())
    if not parent.is_dir():
        raise ExportError(f"--output_dir {out}: {parent} is not a directory; name a new directory")


def export(cfg: ExportConfig, emit: Callable[[str], None] = print, progress: Progress | None = None) -> Path:
    """Calibrate and write the checkpoint; progress: shown the long phases (a new, silent one if None)."""
    progress = Progress() if progress is None else progress
    progress.phase = "checking the inputs"
    out = Path(cfg.output_dir)
    _check_output_dir(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--output_dir {out} exists and is not an empty directory; nothing is overwritten, "
                          f"name a new directory")
    if not os.access(out.parent if out.parent.exists() else Path.cwd(), os.W_OK):
        raise ExportError(f"--output_dir {out}: the parent directory is not writable")
    if is_quamba_dir(cfg.model):
        raise ExportError(f"--model {cfg.model} is already a quantized Quamba checkpoint; export needs the float model")
    ckpt = open_checkpoint(cfg.model)
    plugin = None if cfg.recipe in BUILTIN_EXPORTS else _plugin_exporter(cfg.recipe, ckpt.dims.architecture)
    if plugin is None:
        _check_builtin(cfg, ckpt.dims)
    tok = load_tokenizer(cfg.model, cfg.tokenizer)
    tok_dir = Path(cfg.tokenizer) if cfg.tokenizer is not None else Path(cfg.model)
    tok_files = [tok_dir / n for n in TOKENIZER_FILES if is_regular(tok_dir / n, refuse_in(tok_dir / n))]  # copied
    dims, depth = ckpt.dims, ckpt.dims.n_layer - 1
    with progress.stage("reading the calibration text"):
        windows = calibration_windows(tok, cfg.calib_file, cfg.calib.num_samples, cfg.calib.seqlen, cfg.calib.seed)
    if plugin is not None:  # a registered exporter (a plugin's): it writes the new directory as the built-ins do
        _write_dir(out, tok_files, lambda tmp: plugin.run(cfg, ckpt, windows.ids, tmp, emit, progress), progress)
        emit(f"wrote {out} (exporter {plugin.name!r})")
        return out
    if dims.architecture == "mamba2":  # Quamba2's W8A8 (runner.export_q2)
        write = export_q2_files if cfg.recipe == "w8a8" else export_q2w4_files  # W4: runner.export_q2w4
        _write_dir(out, tok_files, lambda tmp: write(cfg, ckpt, windows.ids, tmp, emit, progress), progress)
        emit(f"wrote {out}: config.json, pytorch_model.bin ({(out / 'pytorch_model.bin').stat().st_size} bytes)"
             f" and the tokenizer files")
        return out
    if cfg.recipe != "w8a8":  # Quamba2's W4A8QMamba / W4A16QMamba (runner.export_m1w4)
        from .w4.export_mamba1 import export_m1w4_files

        config = _config(dims, dims.vocab_size, "Embedding", "Linear")
        _write_dir(out, tok_files, lambda tmp: export_m1w4_files(cfg, ckpt, windows.ids, tmp, emit, progress, config),
                   progress)
        emit(f"wrote {out}: config.json, pytorch_model.bin ({(out / 'pytorch_model.bin').stat().st_size} bytes)"
             f" and the tokenizer files")
        return out
    bank = WeightBank(ckpt)
    result = calibrate(bank, windows.ids, cfg.calib, depth, ckpt.prefix_hashes(depth), cfg.cache_dir, "quamba",
                       progress=progress)
    emit(f"calibration: {result.info['source']} ({cfg.calib.num_samples} samples x {cfg.calib.seqlen} tokens, "
         f"layers 0..{depth}, {result.info['seconds']} s)")
    lm_scale = None
    if cfg.quantize_lm_head:
        with progress.stage("calibrating lm_head's input", -(-windows.ids.shape[0] // cfg.calib.batch_size),
                            "batches"):
            lm_scale = _lm_head_input_scale(bank, windows.ids, cfg.calib.batch_size, depth, progress.advance)
    layers = []
    with progress.stage("quantizing the weights", dims.n_layer, "layers"):
        for i in range(dims.n_layer):
            layers.append(bank.layer(i, "int8", True, "quamba"))
            bank.release(i)  # keep only the int8 codes of the blocks already done
            progress.advance()
    vocab = dims.vocab_size
    rows = vocab + (PAD_VOCAB - vocab % PAD_VOCAB) % PAD_VOCAB
    # the rotated fp16 rows the int8 modes embed with (Quamba1: fp16, not quantized)
    table = bank.embed(torch.arange(vocab)[None], True, torch.float16, "quamba", "int8")[0].to(torch.float16)
    table = pad_rows(table, rows)
    if cfg.quantize_embedding:
        codes, scales = quantize_rows_signed_max_fp16(table)
        embedding = {"backbone.embedding.weight": codes, "backbone.embedding.scales": scales}
    else:
        embedding = {"backbone.embedding.weight": table}
    lm_head = pad_rows(lm_head_weight(ckpt).to(torch.float16), rows)
    if cfg.quantize_lm_head:  # W8A8B16O16Linear.from_fp16 (qLinearLayer.py:771-785)
        lm_head = quantize_weight_fp16(lm_head)
    config = _config(dims, vocab, "W8O16Embedding" if cfg.quantize_embedding else "Embedding",
                     "W8A8B16O16Linear" if cfg.quantize_lm_head else "Linear")
    _write_dir(out, tok_files, lambda tmp: write_quamba(tmp, dims, config, layers, result.scales, embedding=embedding,
                                                        lm_head=lm_head, lm_head_input_scale=lm_scale), progress)
    emit(f"wrote {out}: config.json, pytorch_model.bin ({(out / 'pytorch_model.bin').stat().st_size} bytes)"
         f" and the tokenizer files")
    return out


def _check_builtin(cfg: ExportConfig, dims) -> None:
    """What the built-in recipes refuse of a model (Quamba2's shape constraints)."""
    if dims.architecture == "mamba2" and (problem := check_q2_export(dims, cfg.recipe)):
        raise ExportError(f"--model {cfg.model}: {problem}")
    if cfg.recipe != "w8a8" and (problem := check_q2w4_export(dims, cfg.quantize_embedding, cfg.quantize_lm_head)):
        raise ExportError(f"--model {cfg.model} --recipe {cfg.recipe}: {problem}")


def _plugin_exporter(name: str, architecture: str) -> Exporter:
    """The registered exporter `name` for `architecture`; none is an ExportError naming what is valid."""
    found = get_exporter(name, architecture)
    if found is None:
        valid = [*BUILTIN_EXPORTS, *sorted({e.name for e in exporters() if e.architecture == architecture})]
        raise ExportError(f"--recipe {name}: no exporter of that name for a {architecture} model; "
                          f"valid: {', '.join(valid)}")
    return found


def _write_dir(out: Path, tok_files: list[Path], write: Callable[[Path], None], progress: Progress) -> None:
    """write(tmp) into a new temporary directory beside `out`, the tokenizer files copied, renamed into place."""
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    progress.phase = f"writing {out}"
    try:
        tmp.mkdir(parents=True)
        write(tmp)
        for file in tok_files:
            shutil.copy(file, tmp / file.name)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


INPUT_ERRORS = (ExportError, ModelDirError, DataError, StorageError)
