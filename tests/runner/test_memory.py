"""harness.runtime.memory: freed memory stays for reuse until the explicit trim, which returns it (glibc only)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# in a fresh interpreter: the heap of a long test session is fragmented, a new block need not sit at its top
_PROBE = r"""
import ctypes, ctypes.util, json
from harness.runtime import memory

if memory._mallinfo2 is None:  # not glibc >= 2.33
    print(json.dumps(None)); raise SystemExit
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 8 << 20
block = libc.malloc(size)
ctypes.memset(block, 1, size)
libc.free(block)
kept = memory._mallinfo2().keepcost
free = memory.heap_free()
below = memory.release_freed()             # the free total is far below RELEASE_MIN_FREE: nothing returned
kept_below = memory._mallinfo2().keepcost
released = memory.release_freed(0)
print(json.dumps({"size": size, "kept": kept, "free": free, "below": below, "kept_below": kept_below,
                  "released": released, "after": memory._mallinfo2().keepcost, "mmap": memory.MMAP_THRESHOLD,
                  "trim": memory.TRIM_THRESHOLD, "min_free": memory.RELEASE_MIN_FREE}))
"""


def test_a_freed_block_is_kept_until_release_freed_returns_it():
    """An 8 MB block (below the mmap threshold) freed at the top of the heap stays there for the next
    allocation (the trim threshold): with glibc's default 128 kB it would go back at once and its pages
    fault in again. release_freed() keeps it while the heap's free pages add up to less than
    RELEASE_MIN_FREE (the next block reuses them); release_freed(0) hands it back."""
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    if got is None:
        pytest.skip("not glibc >= 2.33 (mallinfo2)")
    assert got["size"] < got["mmap"] and got["size"] < got["trim"]
    assert got["kept"] >= got["size"]
    assert got["size"] <= got["free"] < got["min_free"]
    assert not got["below"] and got["kept_below"] == got["kept"]
    assert got["released"] and got["after"] < got["size"]
