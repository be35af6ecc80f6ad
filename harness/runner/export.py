"""``python -m harness export``: calibrate every layer of a float model and write a quantized checkpoint with the
exporter ``--recipe`` names for the model's architecture (``recipes.registry.Exporter``: the built-in ones are
Quamba's, harness.recipes.quamba; a plugin registers its own). This module is the command around an exporter:
the inputs checked before any work, the calibration text read, the new directory written beside the output and
renamed into place with the tokenizer files, nothing overwritten.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..checkpoints.loading import ModelDirError, open_checkpoint, refuse_in
from ..checkpoints.tokenizer import load_tokenizer
from ..checkpoints.text import DEFAULT_CALIB_FILE, DataError, calibration_windows
from ..recipes.registry import Exporter, checkpoint_formats, exporters, get_exporter
from ..runtime.guard import Progress
from ..store.files import StorageError, is_regular
from .calibration import CalibrationSettings

__all__ = ["ExportConfig", "ExportError", "export", "exporter_names", "TOKENIZER_FILES", "INPUT_ERRORS"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")


class ExportError(ValueError):
    """Bad export request (output directory not empty, quantized input model, no such exporter)."""


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
    recipe: str = "w8a8"  # the exporter's name (Quamba's: w8a8, w4a8, w4a16; or a plugin's)


def exporter_names(architecture: str | None = None) -> list[str]:
    """The registered exporters' names (of one architecture), in registration order."""
    return list(dict.fromkeys(e.name for e in exporters() if architecture in (None, e.architecture)))


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
    if (fmt := next((f for f in checkpoint_formats() if f.detect(Path(cfg.model))), None)) is not None:
        raise ExportError(f"--model {cfg.model} is already a quantized {fmt.name.capitalize()} checkpoint; "
                          f"export needs the float model")
    ckpt = open_checkpoint(cfg.model)
    exporter = _exporter(cfg.recipe, ckpt.dims.architecture)
    if exporter.check is not None and (problem := exporter.check(cfg, ckpt.dims)):
        raise ExportError(problem)  # what the exporter refuses of this model, before any work
    tok = load_tokenizer(cfg.model, cfg.tokenizer)
    tok_dir = Path(cfg.tokenizer) if cfg.tokenizer is not None else Path(cfg.model)
    tok_files = [tok_dir / n for n in TOKENIZER_FILES if is_regular(tok_dir / n, refuse_in(tok_dir / n))]  # copied
    with progress.stage("reading the calibration text"):
        windows = calibration_windows(tok, cfg.calib_file, cfg.calib.num_samples, cfg.calib.seqlen, cfg.calib.seed)
    _write_dir(out, tok_files, lambda tmp: exporter.run(cfg, ckpt, windows.ids, tmp, emit, progress), progress)
    emit(exporter.summary(out) if exporter.summary is not None else f"wrote {out} (exporter {exporter.name!r})")
    return out


def _exporter(name: str, architecture: str) -> Exporter:
    """The registered exporter `name` for `architecture`; none is an ExportError naming what is valid."""
    found = get_exporter(name, architecture)
    if found is None:
        raise ExportError(f"--recipe {name}: no exporter of that name for a {architecture} model; "
                          f"valid: {', '.join(exporter_names(architecture))}")
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
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if (why := _write_failure(e)) is not None:  # a full disk, an I/O error: one line, nothing left behind
            raise ExportError(f"cannot write {out}: {why}; nothing was left behind") from None
        raise


def _write_failure(e: BaseException) -> str | None:
    """The errno text of a failed write: an OSError, or torch.save's RuntimeError from its zip writer."""
    if isinstance(e, OSError):
        return e.strerror or str(e)
    text = str(e)
    if isinstance(e, RuntimeError) and "PytorchStreamWriter failed" in text:
        return text[text.index("PytorchStreamWriter failed"):].splitlines()[0]
    return None


INPUT_ERRORS = (ExportError, ModelDirError, DataError, StorageError)
