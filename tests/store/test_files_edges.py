"""harness.store.files details: TrailingSha256, the hash of a file taken behind its writer, region by region."""
import hashlib
import threading
import time

import pytest

import harness.store.files as files
from harness.store.files import TrailingSha256


def test_trailing_hash_of_regions_is_the_file_hash(tmp_path):
    """Regions handed over with final() are hashed from where the previous one ended to their own end, while the
    file goes on past them (a mutant that read min(1 MiB, end + start) bytes, hashing part of the next region
    twice, survived: TrailingSha256._feed mutmut 16)."""
    path = tmp_path / "f.bin"
    data = bytes(range(256)) * 4
    path.write_bytes(data)
    t = TrailingSha256(path)
    try:
        t.final(300)
        t.final(700)
        t.final(700)      # nothing new: no region
        assert t.hexdigest() == hashlib.sha256(data).hexdigest() == files.file_sha256(path)
    finally:
        t.close()


def test_trailing_hash_of_a_file_shorter_than_promised_is_an_error(tmp_path):
    """A region that runs past the end of the file is an OSError naming where the file ended and where it should
    have (a mutant that raised OSError(None) survived: TrailingSha256._feed mutmut 18)."""
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 10)
    t = TrailingSha256(path)
    try:
        t.final(25)
        with pytest.raises(OSError, match=r"^the file ended at byte 10 of 25 while it was hashed$"):
            t.hexdigest()
    finally:
        t.close()


def test_trailing_hash_takes_regions_in_order_when_the_first_is_slow(tmp_path, monkeypatch):
    """One worker hashes the regions in the order they were handed over, however long the first takes to read
    (a mutant with max_workers=None let a second worker hash the second region first and the digest was wrong
    only when a read was slow: TrailingSha256.__init__ mutmut 10)."""
    path = tmp_path / "f.bin"
    data = b"a" * 100 + b"b" * 100
    path.write_bytes(data)
    real, first = files.os.pread, threading.Event()

    def slow_first_pread(fd, n, offset):
        if offset == 0 and not first.is_set():
            first.set()
            time.sleep(0.2)
        return real(fd, n, offset)

    monkeypatch.setattr(files.os, "pread", slow_first_pread)
    t = TrailingSha256(path)
    try:
        t.final(100)
        t.final(200)
        assert t.hexdigest() == hashlib.sha256(data).hexdigest()
    finally:
        t.close()
