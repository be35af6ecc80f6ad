"""Each finished block of each mode goes to the file at once: checked, compared with the reference, written, released.

Modes arrive in chunks (``add``: one block's points of every sample, or a whole mode kept by
--resume) and end with ``end``. Memory therefore holds one chunk of one mode: the reference's
arrays, needed by every later mode's comparison, go to a temporary spill directory beside the
output (memory-mapped when read, removed when the run ends) unless ``keep=True`` keeps every
mode's arrays for callers that want ``RunOutcome.by_mode``. A mode that arrives before the
reference ended (kept by --resume) waits until the reference ends or the run ends.
Bit-identical groups of modes are found from a sha256 per array (dtype, shape and bytes), so
no array has to stay in memory for them; an array that an earlier mode had, bit for bit, takes
that mode's metrics (they are a function of the two arrays alone).

docs/spec/modes.md contract 9 (a mode that quantizes must not reproduce a float reference bit for bit)
is decided chunk by chunk: a quantizing mode's chunks are held back only while every block
output seen so far equals the reference's; the first that differs releases them. A mode whose
outputs all equal the reference's is recorded as an error and none of its arrays is written.
"""
from __future__ import annotations

import shutil
import tempfile
import weakref
from pathlib import Path

import numpy as np

from ..runtime.log import error
from ..emulation.capture import RESEARCH_TENSORS
from ..metrics.compare import compare_modes, identical_groups, same_basis
from ..store.format import PairWriter, array_digest, array_key

__all__ = ["Collector", "block_io_names"]


def _outputs(arrays: dict[str, np.ndarray]) -> list[str]:
    return [t for t in arrays if t == "output" or t.endswith(".block.out")]


class _Spill:
    """The reference's arrays as .npy files in a temporary directory, read back memory-mapped."""

    def __init__(self, parent: Path) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=".quamba-harness-reference-", dir=parent))
        self.files: dict[str, Path] = {}
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.dir, True)

    def put(self, tensor: str, arr: np.ndarray) -> None:
        path = self.dir / f"{len(self.files)}.npy"
        np.save(path, arr, allow_pickle=False)
        self.files[tensor] = path

    def get(self, tensor: str) -> np.ndarray:
        return np.load(self.files[tensor], mmap_mode="r", allow_pickle=False)

    def remove(self) -> None:
        self._cleanup()


class Collector:
    def __init__(self, writer: PairWriter | None, reference: str, modes: dict[str, dict], recipes: list,
                 keep: bool = True, spill_dir: Path | None = None, *, unstored: frozenset[str] = frozenset()) -> None:
        self.writer, self.reference, self.modes, self.keep = writer, reference, modes, keep
        self.unstored = unstored                # tensors compared but never written (--no-logits: logits)
        self.ref_names: list[str] = []          # the reference's tensors, in order
        self.ref_done = False
        self._ref_mem: dict[str, np.ndarray] = {}
        self._spill = None if keep or spill_dir is None else _Spill(Path(spill_dir))
        self.by_mode: dict[str, dict[str, np.ndarray]] = {}
        self.rows: dict[str, dict] = {}
        self.skipped: dict[str, dict] = {}
        self.digests: dict[str, dict[str, np.ndarray]] = {}
        self.pending: dict[str, list[dict[str, np.ndarray]]] = {}   # chunks of modes that came before the reference
        self._pending_end: list[str] = []
        self._held: dict[str, list[dict[str, np.ndarray]]] = {}     # chunks of a quantizing mode, outputs equal so far
        self._outputs_seen: set[str] = set()    # held modes with at least one block output seen
        self._released: set[str] = set()        # quantizing modes shown to differ from the reference
        self._known_rows: dict = {}             # (tensor, digest) -> metrics row: an array seen before
        self.error: str | None = None
        ref_recipe = next((r for r in recipes if r.name == reference), None)
        float_ref = ref_recipe is not None and not ref_recipe.needs_calibration
        self._quantizes = {r.name for r in recipes if r.needs_calibration and r.name != reference} if float_ref else set()
        self._comparable = same_basis(lambda m, t: self.modes[m].get("tensors", {}).get(t, {}).get("basis"), reference)

    @property
    def has_reference(self) -> bool:
        return self.ref_done

    def ref_get(self, tensor: str) -> np.ndarray:
        return self._spill.get(tensor) if self._spill is not None else self._ref_mem[tensor]

    def add(self, mode: str, arrays: dict[str, np.ndarray]) -> None:
        """A chunk of a mode's arrays (their stats entries are in `modes[mode]["tensors"]`)."""
        if mode == self.reference:
            self.ref_names.extend(t for t in arrays if t not in self.ref_names)
            for tensor, arr in arrays.items():
                if self._spill is not None:
                    self._spill.put(tensor, arr)
                else:
                    self._ref_mem[tensor] = arr
            self._store(mode, arrays)
        elif not self.ref_done:
            self.pending.setdefault(mode, []).append(arrays)
        elif mode in self._quantizes and "resumed" not in self.modes[mode] and mode not in self._released:
            self._hold(mode, arrays)
        else:
            self._compare_and_store(mode, arrays)

    def end(self, mode: str) -> None:
        """The mode has no more chunks."""
        if mode == self.reference:
            self.ref_done = True
            pending, ended, self.pending, self._pending_end = self.pending, self._pending_end, {}, []
            for other, chunks in pending.items():
                for chunk in chunks:
                    self.add(other, chunk)
            for other in ended:
                self.end(other)
        elif not self.ref_done:
            self._pending_end.append(mode)
        elif mode in self._held:
            held = self._held.pop(mode)
            if mode in self._outputs_seen:  # every block output equals the float reference's
                self.modes[mode].update(status="error", error=(
                    f"the output is bit-identical to {self.reference} although the recipe quantizes: "
                    "the quantization did not take effect"))
                return
            for chunk in held:
                self._compare_and_store(mode, chunk)

    def store_only(self, mode: str, arrays: dict[str, np.ndarray]) -> None:
        """Arrays that are written but take no part in the comparison (generated token ids)."""
        self._store(mode, arrays)

    def failed(self, mode: str) -> None:
        """The mode failed part way: its held chunks are dropped and it leaves the comparison."""
        for table in (self._held, self.rows, self.skipped, self.digests, self.pending):
            table.pop(mode, None)
        self._pending_end = [m for m in self._pending_end if m != mode]

    def _hold(self, mode: str, arrays: dict[str, np.ndarray]) -> None:
        """Hold the chunk while every block output of the mode so far equals the reference's (contract 9)."""
        outputs = _outputs(arrays)
        if all(t in self.ref_names and np.array_equal(self.ref_get(t), arrays[t]) for t in outputs):
            self._held.setdefault(mode, []).append(arrays)
            if outputs:
                self._outputs_seen.add(mode)
            return
        self._released.add(mode)
        for chunk in self._held.pop(mode, []):
            self._compare_and_store(mode, chunk)
        self._compare_and_store(mode, arrays)

    def _compare_and_store(self, mode: str, arrays: dict[str, np.ndarray]) -> None:
        digests = {t: array_digest(a) for t, a in arrays.items()}  # one sha256 per array: dedup, metrics reuse
        if self.error is None:
            ref_names = [t for t in arrays if t in self.ref_names]
            refs: dict[str, np.ndarray] = {}  # each reference array read once for this chunk

            def get(m: str, t: str) -> np.ndarray:
                if m != self.reference:
                    return arrays[t]
                if t not in refs:
                    refs[t] = self.ref_get(t)
                return refs[t]
            try:
                out = compare_modes({self.reference: ref_names, mode: list(arrays)}, get, self.reference,
                                    self._comparable, groups=False, known=self._known_rows,
                                    digest=lambda _m, t: digests[t])
                self.rows.setdefault(mode, {}).update(out["modes"].get(mode, {}))
                if mode in out["skipped"]:
                    self.skipped.setdefault(mode, {}).update(out["skipped"][mode])
            except Exception as e:  # never lose the arrays over the comparison
                self.error = f"{type(e).__name__}: {e}"
                error(f"the comparison failed ({self.error}); the arrays are written")
        self._store(mode, arrays, digests)

    def _store(self, mode: str, arrays: dict[str, np.ndarray], digests: dict[str, bytes] | None = None) -> None:
        if digests is None:  # one sha256 per array, also the writer's dedup key
            digests = {t: array_digest(a) for t, a in arrays.items()}
        self.digests.setdefault(mode, {}).update({t: np.frombuffer(d, dtype=np.uint8) for t, d in digests.items()})
        if self.writer is not None:
            for tensor, arr in arrays.items():
                if tensor not in self.unstored:
                    self.writer.add(array_key(mode, tensor), arr, digests[tensor])
        if self.keep:
            self.by_mode.setdefault(mode, {}).update(arrays)

    def finish(self, order: list[str]) -> dict | None:
        """Write what still waits; the comparison dict (compare.compare_modes's layout), None without a reference."""
        for mode, chunks in self.pending.items():
            for chunk in chunks:
                self._store(mode, chunk)
        self.pending = {}
        if self._spill is not None:
            self._spill.remove()
        self.by_mode = {m: self.by_mode[m] for m in order if m in self.by_mode}
        if not self.ref_done:
            return None
        if self.error is not None:
            return {"error": self.error}
        names = {m: list(d) for m, d in self.digests.items()}
        return {"reference": self.reference, "modes": {m: self.rows[m] for m in order if m in self.rows},
                "skipped": {m: self.skipped[m] for m in order if m in self.skipped},
                "identical_groups": identical_groups({m: names[m] for m in order if m in names},
                                                     lambda m, t: self.digests[m][t])}


def block_io_names(names) -> list[str]:
    return [t for t in names or [] if t in RESEARCH_TENSORS.values() or ".block." in t]
