"""Give freed memory back to the operating system (glibc), so peak RSS follows what is really held.

glibc's malloc raises its mmap threshold after large blocks are freed (up to 32 MB), so the
activations of later blocks come from the heap, and what they free stays in the process: eight
prepared 130m blocks left 634 MB resident where 224 MB were held (measured, tools in
benchmarks/bench_layers.py). ``malloc_trim(0)`` returns the free pages; it is called between
blocks and modes, once the free pages add up to ``RELEASE_MIN_FREE`` (below it the next block reuses
them: returning them costs their page faults); the mmap and trim thresholds are fixed when this
module is imported (``MMAP_THRESHOLD``, ``TRIM_THRESHOLD``).
Elsewhere than glibc (macOS, musl) it does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["release_freed", "heap_free", "MMAP_THRESHOLD", "TRIM_THRESHOLD", "RELEASE_MIN_FREE"]

# Blocks from this size up are mapped on their own and unmapped when freed. Fixed, glibc stops
# raising the threshold to the largest block freed so far (up to 32 MB): the 25 MB float64 rows of
# the end-to-end metrics then no longer pile up in the heap (+473 MB resident for a 130m model's
# logits, +129 MB with it). Activations of one block (a few MB) stay below it, in the heap.
MMAP_THRESHOLD = 16 << 20
_M_MMAP_THRESHOLD = -3  # glibc malloc.h
# Free memory at the top of the heap is kept up to this size between the explicit trims, instead of
# glibc's default 128 kB (which becomes the fixed value once the mmap threshold is set): otherwise
# every freed activation is returned at once and the next one faults its pages in again, and page
# faults are slow on virtual machines (float64 copies of a 512 x 768 block output: 2.2 ms each with
# the default, 0.08 ms with it; measured on the benchmark machine).
TRIM_THRESHOLD = 128 << 20
_M_TRIM_THRESHOLD = -1

# release_freed returns the heap's free pages only from this total up. Each page returned faults in
# again when the next block allocates it: the eight modes of layer 0 of a 130m model (seq 512) freed
# 60 to 190 MB between blocks, and trimming that every time made their forwards 0.2 to 0.4 s slower
# (of about 0.7 s; benchmarks/bench_quamba.py) for a peak RSS about 100 MB lower.
RELEASE_MIN_FREE = 256 << 20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


_trim = _mallinfo2 = None
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _trim = _libc.malloc_trim
    _trim.argtypes, _trim.restype = [ctypes.c_size_t], ctypes.c_int
    _libc.mallopt.argtypes, _libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    _libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
except (OSError, AttributeError):  # not glibc
    _trim = None
try:
    _mallinfo2 = _libc.mallinfo2  # glibc >= 2.33
    _mallinfo2.argtypes, _mallinfo2.restype = [], _MallInfo2
except (NameError, AttributeError):
    _mallinfo2 = None


def heap_free() -> int | None:
    """Bytes free in the heap (glibc's mallinfo2 fordblks): held by the process, not by Python; None elsewhere."""
    return int(_mallinfo2().fordblks) if _mallinfo2 is not None else None


def release_freed(min_free: int = RELEASE_MIN_FREE) -> bool:
    """Return the heap's free pages to the system once they add up to `min_free` bytes (0: always);
    True when something was returned. Without mallinfo2 (glibc < 2.33) it always trims."""
    if _trim is None:
        return False
    free = heap_free()
    if free is not None and free < min_free:
        return False
    return bool(_trim(0))
