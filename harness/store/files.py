"""Safe file writing and reading: refusal of special files and of a run's inputs, temporary files that follow
the umask, fsync, atomic renames, sha256 of files; files read only when they are regular files.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO, Callable

from ..runtime.guard import fault_point

__all__ = ["StorageError", "check_output", "check_writable", "file_sha256", "file_kind", "temp_file", "write_file",
           "fsync_dir", "remove_files", "atomic_write", "TrailingSha256", "open_regular", "read_regular", "is_regular",
           "same_file"]


class StorageError(ValueError):
    """A capture file is missing, corrupted or of an unsupported version."""


def file_kind(mode: int) -> str | None:
    """What a non-regular file is, in words (None for a regular file)."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return None if stat.S_ISREG(mode) else "not a regular file"


# what the file is instead ("a FIFO, not a regular file", "larger than 1048576 bytes") -> the exception to raise
Refusal = Callable[[str], Exception]


def _not_regular(path) -> Refusal:
    return lambda what: StorageError(f"cannot read {path}: it is {what}")


def open_regular(path: Path | str, refuse: Refusal | None = None) -> BinaryIO:
    """`path` opened for reading in binary, refused before a byte is read unless it is a regular file.

    The open does not block on a FIFO (O_NONBLOCK) and the check is made on the opened file (fstat, links
    followed: a link to /dev/zero is a character device), so nothing can be swapped in between; then the file
    is made blocking again. refuse(what) is raised for anything else (default: a StorageError naming the
    path); a missing or unreadable file raises the OSError of the open.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        kind = file_kind(os.fstat(fd).st_mode)
        if kind is not None:
            raise (refuse or _not_regular(path))(f"{kind}, not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: Path | str, limit: int, refuse: Refusal | None = None) -> bytes:
    """The bytes of a regular file of at most `limit` bytes (open_regular; a larger file is refused with
    refuse(f"larger than {limit} bytes") after reading no more than limit + 1 bytes)."""
    with open_regular(path, refuse) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise (refuse or _not_regular(path))(f"larger than {limit} bytes")
    return data


def is_regular(path: Path | str, refuse: Refusal | None = None) -> bool:
    """Whether a regular file is at `path` (links followed); False when nothing is there, an error raised
    (refuse(what)) for a special file, so that a FIFO or a device is named instead of being taken for a missing file."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as e:  # a loop of links, no permission to look: named, not taken for a missing file
        raise (refuse or _not_regular(path))(f"not readable ({e.strerror})") from None
    kind = file_kind(st.st_mode)
    if kind is not None:
        raise (refuse or _not_regular(path))(f"{kind}, not a regular file")
    return True


def same_file(a: Path | str, b: Path | str) -> bool:
    """One file under two names: the same path once links are resolved (also when it does not exist yet),
    or the same inode (a hard link)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_output(path: Path, inputs: dict[str, Path | None] | None = None) -> None:
    """Refuse an output path that exists and is not a regular file, or that is one of `inputs`.

    inputs: description -> path of every file the run reads (the model's config and weights, the
    tokenizer, the text files, the modes file, ...). An output never replaces one of them.
    """
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return  # a path that does not exist yet is no input
    except OSError as e:
        raise StorageError(f"cannot write {path}: {e.strerror}") from None
    kind = file_kind(st.st_mode)
    if kind is not None:
        raise StorageError(f"cannot write {path}: it is {kind}, not a regular file; the harness never replaces "
                           f"special files or directories; choose a file name such as out.npz")
    for what, other in (inputs or {}).items():
        if other is None:
            continue
        try:
            same = os.path.samefile(path, other)
        except OSError:
            continue
        if same:
            raise StorageError(f"cannot write {path}: it is {what} of this run ({other}); "
                               f"choose an output path that is not one of the run's inputs")


def check_writable(path: Path, nbytes: int = 0) -> None:
    """Fail before any work if `path` cannot be written or its disk lacks `nbytes` (+10%) of space."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise StorageError(f"cannot write {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise StorageError(f"cannot write {path}: directory {parent} is not writable")
    check_output(path)
    free = shutil.disk_usage(parent).free
    if nbytes and free < nbytes * 1.1:
        raise StorageError(f"not enough disk space for {path}: about {nbytes / 2**20:.1f} MiB needed, "
                           f"{free / 2**20:.1f} MiB free in {parent}")


def umask_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def temp_file(path: Path) -> str:
    """A temporary file next to `path` (same file system, so the rename is atomic), mode from the umask."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent if str(path.parent) else ".")
    os.fchmod(fd, umask_mode())
    os.close(fd)
    return tmp


def write_file(tmp: str, write, fault: str | None = None) -> None:
    with open(tmp, "wb") as f:
        write(f)
        if fault:
            fault_point(fault)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory if str(directory) else ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_files(*paths) -> None:
    for p in paths:
        if p is not None and os.path.lexists(p):
            os.unlink(p)


def atomic_write(path: Path, write) -> None:
    path = Path(path)
    tmp = temp_file(path)
    try:
        write_file(tmp, write)
        os.replace(tmp, path)
    finally:
        remove_files(tmp)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open_regular(path) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()




class TrailingSha256:
    """sha256 of a file that is only ever appended to, hashed behind its writer.

    ``final(end)`` says the first `end` bytes will not change any more (written and flushed); a worker
    thread reads them back (from the page cache) and hashes them while the writer goes on, so that
    ``hexdigest()`` (the file complete) only has the tail left to hash. The digest is file_sha256's.
    """

    def __init__(self, path: Path | str) -> None:
        self._fd = os.open(path, os.O_RDONLY)
        self._hash = hashlib.sha256()
        self._queued = 0
        self._pool = ThreadPoolExecutor(max_workers=1)  # one worker: the regions are hashed in order
        self._jobs: list[Future] = []

    def _feed(self, start: int, end: int) -> None:
        while start < end:
            block = os.pread(self._fd, min(1 << 20, end - start), start)
            if not block:
                raise OSError(f"the file ended at byte {start} of {end} while it was hashed")
            self._hash.update(block)
            start += len(block)

    def final(self, end: int) -> None:
        if end > self._queued:
            self._jobs.append(self._pool.submit(self._feed, self._queued, end))
            self._queued = end

    def hexdigest(self) -> str:
        self.final(os.fstat(self._fd).st_size)
        for job in self._jobs:
            job.result()
        return self._hash.hexdigest()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        os.close(self._fd)
