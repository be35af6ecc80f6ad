"""Each finished mode goes to the file at once: checked, compared with the reference, written, released.

Memory therefore holds the reference's arrays and one mode's, not every mode's
(``keep=True`` keeps them all for callers that want ``RunOutcome.by_mode``). A mode that
arrives before the reference (kept by --resume) waits until the reference arrives or the
run ends. Bit-identical groups of modes are found from a sha256 per array (dtype, shape
and bytes), so no array has to stay in memory for them.
"""
from __future__ import annotations

import hashlib
import sys
import numpy as np

from .compare import compare_modes, identical_groups, same_basis
from .runchecks import check_quantized_differ
from .storage import PairWriter, array_key

__all__ = ["Collector", "block_io_names"]


def _digest(arr: np.ndarray) -> np.ndarray:
    arr = np.ascontiguousarray(arr)
    h = hashlib.sha256(f"{arr.dtype.str}{arr.shape}".encode())
    h.update(arr.tobytes())
    return np.frombuffer(h.digest(), dtype=np.uint8)


class Collector:
    def __init__(self, writer: PairWriter | None, reference: str, modes: dict[str, dict], recipes: list,
                 keep: bool = True) -> None:
        self.writer, self.reference, self.modes, self.recipes, self.keep = writer, reference, modes, recipes, keep
        self.ref_arrays: dict[str, np.ndarray] | None = None
        self.by_mode: dict[str, dict[str, np.ndarray]] = {}
        self.rows: dict[str, dict] = {}
        self.skipped: dict[str, dict] = {}
        self.digests: dict[str, dict[str, np.ndarray]] = {}
        self.pending: list[tuple[str, dict]] = []
        self.error: str | None = None
        self._comparable = same_basis(lambda m, t: self.modes[m].get("tensors", {}).get(t, {}).get("basis"), reference)

    def add(self, mode: str, arrays: dict[str, np.ndarray]) -> None:
        """A mode's arrays (its stats entry is in `modes`): compared, written, and released unless kept."""
        if mode == self.reference:
            self.ref_arrays = arrays
            self._store(mode, arrays)
            for other, other_arrays in self.pending:
                self._compare_and_store(other, other_arrays)
            self.pending = []
        elif self.ref_arrays is None:
            self.pending.append((mode, arrays))
        else:
            self._compare_and_store(mode, arrays)

    def _compare_and_store(self, mode: str, arrays: dict[str, np.ndarray]) -> None:
        both = {self.reference: self.ref_arrays, mode: arrays}
        check_quantized_differ(self.recipes, self.modes, both, self.reference)
        if mode not in both:  # the recipe's quantization did not take effect: recorded as an error, no arrays
            return
        if self.error is None:
            try:
                out = compare_modes({m: list(a) for m, a in both.items()}, lambda m, t: both[m][t], self.reference,
                                    self._comparable)
                self.rows[mode] = out["modes"].get(mode, {})
                if mode in out["skipped"]:
                    self.skipped[mode] = out["skipped"][mode]
            except Exception as e:  # never lose the arrays over the comparison
                self.error = f"{type(e).__name__}: {e}"
                print(f"error: the comparison failed ({self.error}); the arrays are written", file=sys.stderr)
        self._store(mode, arrays)

    def _store(self, mode: str, arrays: dict[str, np.ndarray]) -> None:
        self.digests[mode] = {t: _digest(a) for t, a in arrays.items()}
        if self.writer is not None:
            for tensor, arr in arrays.items():
                self.writer.add(array_key(mode, tensor), arr)
        if self.keep or mode == self.reference:
            self.by_mode[mode] = arrays

    def finish(self, order: list[str]) -> dict | None:
        """Write what still waits; the comparison dict (compare.compare_modes's layout), None without a reference."""
        for mode, arrays in self.pending:
            self._store(mode, arrays)
        self.pending = []
        self.by_mode = {m: self.by_mode[m] for m in order if m in self.by_mode}
        if self.ref_arrays is None:
            return None
        if self.error is not None:
            return {"error": self.error}
        names = {m: list(d) for m, d in self.digests.items()}
        return {"reference": self.reference, "modes": {m: self.rows[m] for m in order if m in self.rows},
                "skipped": {m: self.skipped[m] for m in order if m in self.skipped},
                "identical_groups": identical_groups({m: names[m] for m in order if m in names},
                                                     lambda m, t: self.digests[m][t])}


def block_io_names(arrays: dict[str, np.ndarray] | None) -> list[str]:
    return [t for t in arrays or {} if t in ("input", "output", "residual") or ".block." in t]

