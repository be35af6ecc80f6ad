"""harness.memory: freed memory stays for reuse until the explicit trim, which returns it (glibc only)."""
import ctypes
import ctypes.util

import pytest

from harness import memory


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        pytest.skip("not glibc >= 2.33 (mallinfo2)")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


def test_a_freed_block_is_kept_until_release_freed_returns_it():
    """An 8 MB block (below the mmap threshold) freed at the top of the heap stays there for the next
    allocation (the trim threshold): with glibc's default 128 kB it would go back at once and its pages
    fault in again. release_freed() then hands it back."""
    libc = _libc()
    size = 8 << 20
    assert size < memory.MMAP_THRESHOLD and size < memory.TRIM_THRESHOLD
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
    assert libc.mallinfo2().keepcost >= size
    assert memory.release_freed()
    assert libc.mallinfo2().keepcost < size
