"""A .npy member of a capture archive checked from its header before numpy allocates anything.

``np.load`` of an archive member allocates the array its header declares and then reads the data:
a crafted header declaring (1e5, 1e5, 1e5) float32 over 64 bytes of data asks for 4 PB. The header
is read here first and the declared size compared with the bytes the member holds.
"""
from __future__ import annotations

import math
import zipfile
import zlib

import numpy as np

from .files import StorageError

__all__ = ["check_member"]

_HEADER_READERS = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


def check_member(zf: zipfile.ZipFile, member: str, where: str) -> None:
    """Raise StorageError unless `member` of `zf` is a .npy whose header declares a plain (non-object)
    dtype and exactly the number of data bytes the member holds; `where` starts the message (the file
    and the array asked for)."""
    try:
        info = zf.getinfo(member)
        with zf.open(info) as fh:
            version = np.lib.format.read_magic(fh)
            reader = _HEADER_READERS.get(version)
            if reader is None:
                raise ValueError(f".npy format version {version[0]}.{version[1]} (capture arrays are 1.0 or 2.0)")
            shape, _fortran, dtype = reader(fh)
            header = fh.tell()
    except (KeyError, ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        raise StorageError(f"{where}: member {member} is not a readable .npy array ({type(e).__name__}: {e})") from None
    if dtype.hasobject:
        raise StorageError(f"{where}: member {member} holds Python objects ({dtype}); capture arrays are numeric "
                           f"and objects are never unpickled")
    declared = math.prod(int(n) for n in shape) * dtype.itemsize
    held = info.file_size - header
    if declared != held:
        raise StorageError(f"{where}: member {member} declares shape {tuple(shape)} of {dtype} ({declared} bytes) "
                           f"but holds {held} bytes of data: a corrupt or crafted file")
