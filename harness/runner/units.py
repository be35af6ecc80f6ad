"""The units of a run as plain data, and what a worker process does with one.

A unit is independent of every other unit of its phase:

* ``SampleUnit``: one mode on one sample window (``Forward`` with a single sample). It hands back, per
  block, the unstacked arrays, codes and capture metadata (``forwards.run_mode(raw=...)``), the logits
  and the block inputs the reference keeps; the driver stacks the samples of a mode with
  ``forwards.layer_arrays`` (the very code of a serial run) and feeds the ``Collector`` in serial order.
* ``LayerUnit``: one mode x one layer of the sensitivity study: the per-sample KL of the reference model
  with that block in the mode (``forwards.sensitivity_kl`` on the one layer).

What travels: the ``Forward`` (recipe, calibrated scales, token windows), the model's paths, the reference's
block inputs a unit needs (inline) and the reference's logits (a ``Blob``: a file beside the output, read
memory-mapped by local workers, or one Ray object shared by the tasks of a node). A worker opens the
checkpoint lazily and keeps one weight bank per model for all its units, so it reads each tensor its
units need at most once, and nothing deeper than the unit's depth.

Test hook: a worker passes ``guard.fault_point("unit.<label>")`` and ``("unit.<label>.attempt<n>")``
before it runs a unit (``QUAMBA_HARNESS_FAULT=unit.0.s1:KILL`` kills every worker that runs mode 0's
sample 1).
"""
from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..plugins import load_all
from ..runtime.guard import fault_point
from .forwards import Forward, RefInputs, run_mode, sensitivity_kl

__all__ = ["ModelRef", "SampleUnit", "LayerUnit", "SampleResult", "Blob", "FileBlob", "execute", "unit_label",
           "UnitFailed"]


class UnitFailed(RuntimeError):
    """A unit whose worker died on every attempt (killed, out of memory, node lost)."""


@dataclass(frozen=True)
class ModelRef:
    """What every unit of a run shares: how a worker opens the run's models (``pairing.open_models``: paths
    valid on the worker's machine) and the plugins it loads first (``harness.plugins``: absolute paths of
    files, module names)."""

    model: Path
    mamba_model_path: Path | None = None
    plugins: tuple[str, ...] = ()


class Blob:
    """A large read-only value shipped once and read by many units (``get``)."""

    def get(self):  # pragma: no cover - the interface
        raise NotImplementedError


@dataclass(frozen=True)
class FileBlob(Blob):
    """A list of arrays saved as .npy files (local workers read them memory-mapped)."""

    paths: tuple[str, ...]

    def get(self) -> list[np.ndarray]:
        return [np.load(p, mmap_mode="r", allow_pickle=False) for p in self.paths]


@dataclass(frozen=True)
class SampleUnit:
    model: ModelRef
    forward: Forward                 # one sample
    sample: int
    ref_inputs: RefInputs | None = None  # this sample's reference block inputs (--isolated)


@dataclass(frozen=True)
class LayerUnit:
    model: ModelRef
    mode: Forward
    ref: Forward
    layer: int
    ref_inputs: RefInputs            # every sample, this layer only
    ref_logits: Blob                 # the reference's logits, per sample


@dataclass
class SampleResult:
    chunks: list[tuple[dict, dict, dict]] = field(default_factory=list)  # per block: per_sample, codes, meta
    logits: list[np.ndarray] = field(default_factory=list)
    block_inputs: list[dict[int, torch.Tensor]] = field(default_factory=list)
    tensors_read: dict[str, dict[str, int]] = field(default_factory=dict)  # "primary"/"float" -> key -> bytes
    x_groups: dict = field(default_factory=dict)  # layer -> metrics.q2groups.XGroupSums of this sample
    segments: dict = field(default_factory=dict)  # layer -> metrics.segments.SegmentSums of this sample


def unit_label(unit: SampleUnit | LayerUnit) -> str:
    """mode.s<sample> or mode.L<layer>: the name in progress lines, failures and fault points."""
    if isinstance(unit, SampleUnit):
        return f"{unit.forward.recipe.name}.s{unit.sample}"
    return f"{unit.mode.recipe.name}.L{unit.layer}"


_MODELS: dict[ModelRef, object] = {}   # per worker process: the opened models, their bank kept between units
_BLOBS: dict[Blob, object] = {}


def _models(ref: ModelRef):
    from .pairing import open_models  # the worker's first unit opens them (lazily: nothing read yet)

    if ref not in _MODELS:
        _MODELS.clear()
        _MODELS[ref] = open_models(ref.model, ref.mamba_model_path)
    return _MODELS[ref]


def _blob(blob: Blob):
    if blob not in _BLOBS:
        _BLOBS.clear()
        _BLOBS[blob] = blob.get()
    return _BLOBS[blob]


def _reads(models) -> dict[str, dict[str, int]]:
    out = {"primary": dict(models.primary.tensors_read)}
    if models.float_ckpt is not None and models.float_ckpt is not models.primary:
        out["float"] = dict(models.float_ckpt.tensors_read)
    return out


def execute(unit: SampleUnit | LayerUnit, attempt: int = 1):
    """Run one unit in this process: a SampleResult, or (LayerUnit) the per-sample KL list."""
    label = unit_label(unit)
    fault_point(f"unit.{label}")
    fault_point(f"unit.{label}.attempt{attempt}")
    load_all(unit.model.plugins)  # once per process: the plugin's family runs the unit's mode here too
    models = _models(unit.model)
    if isinstance(unit, SampleUnit):
        result = SampleResult()
        run = run_mode(unit.forward, models.bank, unit.ref_inputs,
                       raw=lambda per, codes, meta: result.chunks.append((per, codes, meta)))
        result.logits, result.block_inputs, result.x_groups = run.logits, run.block_inputs, run.x_groups
        result.segments = run.segments
        result.tensors_read = _reads(models)
        return result
    from ..metrics.logits import kl_divergence

    logits = _blob(unit.ref_logits)  # read-only (memory-mapped, or Ray's zero-copy arrays): only read here
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        kl = sensitivity_kl(unit.mode, unit.ref, models.bank, unit.ref_inputs, logits, [unit.layer], kl_divergence)
    return kl[unit.layer]


def worker_setup() -> None:
    """One torch thread per worker (the driver's processes share the cores)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def timed(unit: SampleUnit | LayerUnit, attempt: int = 1) -> tuple[object, float, str]:
    """execute(unit) -> (result, seconds, worker name: host:pid)."""
    import socket

    start = time.perf_counter()
    result = execute(unit, attempt)
    return result, time.perf_counter() - start, f"{socket.gethostname()}:{os.getpid()}"
