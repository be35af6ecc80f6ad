"""What a run is asked to do (RunConfig) and what it hands back (RunOutcome).

RunConfig mirrors the command line of ``save_first_layer_io.py`` one field per option; the
pipeline validates it before opening anything.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..checkpoints.text import DEFAULT_CALIB_FILE, DEFAULT_TEXT_FILE
from .calibration import CalibrationSettings, default_cache_dir

__all__ = ["RunConfig", "RunOutcome", "RunError", "DEFAULT_MODEL"]

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "models" / "mamba-tiny"  # the repository root


class RunError(ValueError):
    """Invalid run configuration (e.g. --resume against a different run)."""




@dataclass
class RunConfig:
    model: Path = DEFAULT_MODEL
    mamba_model_path: Path | None = None  # float model paired with a quantized (Quamba) --model
    tokenizer: Path | None = None
    modes: list[str] = field(default_factory=lambda: ["all"])
    modes_file: Path | None = None
    output_file: Path = Path("first_layer_io_all_modes.npz")
    seq_len: int = 512
    text_file: Path = DEFAULT_TEXT_FILE
    calib: CalibrationSettings = field(default_factory=CalibrationSettings)
    calib_file: Path = DEFAULT_CALIB_FILE
    cache_dir: Path | None = field(default_factory=default_cache_dir)  # as the command line: $QUAMBA_HARNESS_CACHE or
                                      # ~/.cache/quamba-harness; None: no calibration cache (--no-cache)
    layers: list = field(default_factory=lambda: [0])  # block indices or "all", "-1", "0-5" (capture.resolve_layers)
    taps: list[str] = field(default_factory=list)
    basis: str = "original"
    stats_only: bool = False
    resume: bool = False
    compress: bool = False
    dedup: bool = False  # --dedup: a tap array equal to an earlier one is stored once (an alias)
    reference: str = "fp32"
    argv: list[str] = field(default_factory=list)
    rerun: list[str] = field(default_factory=list)  # with resume: modes run again although the file holds them
    reference_required: bool = False  # --reference was given: it must be one of the run's (or the file's) modes
    samples: int = 1                  # disjoint windows of seq_len tokens (analysis, samples)
    isolated: bool = False            # L{i}.block.isolated: each captured block on the reference's input
    end_to_end: bool = False          # final norm + lm_head: logits, KL, top-1, cross-entropy, perplexity
    sensitivity: bool = False         # KL with one block at a time in the mode (implies end_to_end)
    device: str = "cpu"
    keep_arrays: bool = True          # RunOutcome.by_mode holds every mode's arrays (False: the reference's only)
    report: bool = False              # the caller writes the HTML report next to the output: its path is checked
    decode: int = 0                   # teacher-forced decode steps after the --seq_len prompt (runner.decode)
    generate: int = 0                 # greedy tokens each mode generates after the prompt (runner.generate)
    store_logits: bool = True         # with end_to_end: the logits arrays go to the .npz (False: metrics only)
    workers: int = 1                  # local processes running the units (runner.workers); 1: in this process
    ray: str | None = None            # a Ray cluster's address (or "auto") running the units (runner.ray_backend)
    plugins: list[str] = field(default_factory=list)  # --plugin FILE_OR_MODULE: loaded (with the installed entry
                                                      # points) before the modes are resolved, and in every worker


@dataclass
class RunOutcome:
    stats: dict                                   # the _stats.json content
    by_mode: dict[str, dict[str, np.ndarray]]     # mode -> tensor -> array (before dedup; also with --stats-only);
                                                  # with keep_arrays=False only the reference's
    failed: list[str]
    token_ids: np.ndarray                         # (samples, seq_len) int64
