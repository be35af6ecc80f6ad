"""The driver's side of units run elsewhere (--workers, --ray): submit, wait in serial order, merge.

``Dispatcher.run_mode`` stands in for ``forwards.run_mode`` in the mode loop: it waits for the mode's
sample units (submitted early, so the modes run side by side), stacks their blocks with
``forwards.layer_arrays`` (the serial run's code) and hands each block to ``on_layer`` in block order,
so the ``Collector`` sees exactly what a serial run gives it. ``sensitivity`` runs the mode x layer units
of the study. A backend (``workers.LocalPool`` or ``ray_backend.RayPool``) has ``submit(unit) -> handle``,
``result(handle)`` (raising the unit's exception or ``units.UnitFailed``), ``ship(arrays) -> Blob``,
``close()``, ``n`` (parallel slots), ``name`` and ``retried``.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

from ..plugins import canonical
from ..runtime.log import error
from .config import RunConfig, RunError
from .forwards import Forward, ModeRun, RefInputs, layer_arrays
from .units import LayerUnit, ModelRef, SampleUnit, UnitFailed

__all__ = ["Dispatcher", "Tracker", "open_units"]


class Tracker:
    """One line per finished unit (mode, sample or layer, worker, seconds) and the time left, from the
    throughput so far (units done per wall second since the first submission)."""

    def __init__(self, emit: Callable[[str], None]) -> None:
        self.emit, self.expected, self.finished, self.start = emit, 0, 0, None
        self.unit_seconds, self.last = 0.0, None

    def expect(self, n: int) -> None:
        self.start = time.perf_counter() if self.start is None else self.start
        self.expected += n

    def done(self, label: str, worker: str, seconds: float, attempt: int) -> None:
        self.finished += 1
        self.unit_seconds += seconds
        self.last = time.perf_counter()
        mode, _, part = label.rpartition(".")
        what = f"sample {part[1:]}" if part.startswith("s") else f"layer {part[1:]}"
        left = self.expected - self.finished
        rate = (time.perf_counter() - self.start) / self.finished
        retry = f", retry {attempt - 1}" if attempt > 1 else ""
        self.emit(f"unit mode {mode} {what} on {worker}: {seconds:.2f} s{retry} ({self.finished}/{self.expected}"
                  + (f"; about {rate * left:.0f} s left)" if left else ")"))


class Dispatcher:
    def __init__(self, backend, models, model: ModelRef, emit: Callable[[str], None]) -> None:
        self.backend, self.models, self.model = backend, models, model
        self.tracker = Tracker(emit)
        backend.on_done = self.tracker.done
        self._modes: dict[str, list] = {}    # submitted modes whose results the loop has not taken yet
        self._submitted: set[str] = set()
        self.failed_units: list[dict] = []

    def submitted(self, mode: str) -> bool:
        return mode in self._submitted

    def submit_mode(self, fwd: Forward, ref_inputs: RefInputs | None = None) -> None:
        """One unit per sample of the mode (once; a later call for the same mode does nothing)."""
        if fwd.recipe.name in self._submitted:
            return
        self._submitted.add(fwd.recipe.name)
        units = [SampleUnit(self.model, replace(fwd, samples=[ids]), k,
                            None if ref_inputs is None else RefInputs(ref_inputs.rotated, [ref_inputs.by_sample[k]]))
                 for k, ids in enumerate(fwd.samples)]
        self.tracker.expect(len(units))
        self._modes[fwd.recipe.name] = [self.backend.submit(u) for u in units]

    def run_mode(self, fwd: Forward, bank=None, ref_inputs: RefInputs | None = None, on_layer=None,
                 shared=None) -> ModeRun:
        """forwards.run_mode's result and on_layer calls, from the mode's sample units (bank, shared: unused,
        each worker has its own)."""
        self.submit_mode(fwd, ref_inputs)
        results = []
        for k, handle in enumerate(self._modes.pop(fwd.recipe.name)):
            try:
                results.append(self.backend.result(handle))
            except UnitFailed as e:
                self.failed_units.append({"unit": f"{fwd.recipe.name}.s{k}", "error": str(e)})
                raise
        for r in results:
            for what, ckpt in (("primary", self.models.primary), ("float", self.models.float_ckpt)):
                if ckpt is not None and what in r.tensors_read:
                    ckpt.tensors_read.update(r.tensors_read[what])
        for b in range(len(results[0].chunks) if results else 0):
            per, codes, meta = {}, {}, {}
            for r in results:  # in sample order, as the serial run appends them
                p, c, m = r.chunks[b]
                for name in p:
                    per.setdefault(name, []).extend(p[name])
                    codes.setdefault(name, []).extend(c[name])
                meta.update(m)  # the last sample's metadata, as in a serial run
                r.chunks[b] = None
            on_layer(*layer_arrays(fwd.recipe, fwd.basis, per, codes, meta))
        run = ModeRun()
        run.logits = [x for r in results for x in r.logits]
        run.block_inputs = [x for r in results for x in r.block_inputs]
        for r in results:  # in sample order, as the serial run adds them
            for mine, theirs in ((run.x_groups, r.x_groups), (run.segments, getattr(r, "segments", {}))):
                for layer, sums in theirs.items():
                    if layer in mine:
                        mine[layer].merge(sums)
                    else:
                        mine[layer] = sums
        return run

    def sensitivity(self, forwards: dict[str, tuple[Forward, Forward]], ref_inputs: RefInputs, ref_logits: list,
                    layers: list[int]) -> dict[str, dict[int, list[float]]]:
        """mode -> layer -> per-sample KL, from one unit per mode and layer (forwards: mode -> (its Forward,
        the reference's)). A failed unit is left out and recorded in ``failed_units``."""
        blob = self.backend.ship(ref_logits)
        handles = {}
        for mode, (mine, ref) in forwards.items():
            for layer in layers:
                inputs = RefInputs(ref_inputs.rotated, [{layer: s[layer]} for s in ref_inputs.by_sample])
                handles[(mode, layer)] = self.backend.submit(LayerUnit(self.model, mine, ref, layer, inputs, blob))
        self.tracker.expect(len(handles))
        out: dict[str, dict[int, list[float]]] = {mode: {} for mode in forwards}
        for (mode, layer), handle in handles.items():
            try:
                out[mode][layer] = self.backend.result(handle)
            except Exception as e:  # recorded; the other units are kept
                self.failed_units.append({"unit": f"{mode}.L{layer}", "error": f"{type(e).__name__}: {e}"})
                error(f"sensitivity of mode {mode} at layer {layer} failed: {type(e).__name__}: {e}")
        return out

    def summary(self) -> dict:
        """The worker provenance of the stats (not part of the bit-identity with a serial run)."""
        return {"backend": self.backend.name, "slots": self.backend.n, "units": self.tracker.finished,
                "unit_seconds": round(self.tracker.unit_seconds, 3),
                "wall_seconds": None if self.tracker.last is None else round(self.tracker.last - self.tracker.start, 3),
                "retried": list(self.backend.retried),
                "failed_units": list(self.failed_units)}


@contextmanager
def open_units(cfg: RunConfig, models, emit: Callable[[str], None]) -> Iterator[Dispatcher | None]:
    """The run's dispatcher (None: a serial run); closed (its workers stopped, its files removed) on the way
    out, an interruption included. --ray connects here: a missing extra or an unreachable cluster is a RunError."""
    if cfg.ray is not None and cfg.workers > 1:
        raise RunError("--workers and --ray do not combine: --workers N runs N local processes, --ray the "
                       "cluster's (its size is the cluster's); give one of them")
    if cfg.workers < 1:
        raise RunError(f"--workers must be a positive integer, got {cfg.workers}")
    if cfg.ray is None and cfg.workers == 1:
        yield None
        return
    plugins = tuple(canonical(s) for s in cfg.plugins)
    if cfg.ray is not None:
        from .ray_backend import RayPool  # ray is imported only here

        backend = RayPool(cfg.ray, cfg.device)
    else:
        from .workers import LocalPool

        backend = LocalPool(cfg.workers, Path(cfg.output_file).resolve().parent, plugins=plugins)
    model = ModelRef(Path(cfg.model).resolve(),
                     None if cfg.mamba_model_path is None else Path(cfg.mamba_model_path).resolve(), plugins)
    try:
        yield Dispatcher(backend, models, model, emit)
    finally:
        backend.close()
