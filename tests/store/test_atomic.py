"""Atomic writes: a failure in the middle of writing leaves the previous file intact and no temporary file."""
import json
import os

import numpy as np
import pytest

from harness.store import format as storage
from harness.store.format import write_json, write_npz


def _previous(tmp_path):
    path = tmp_path / "cap.npz"
    write_npz(path, {"mode_0_input": np.arange(4, dtype=np.float32)})
    return path, path.read_bytes()


def _leftovers(tmp_path, keep):
    return sorted(p.name for p in tmp_path.iterdir() if p.name not in keep)


def test_failure_in_the_middle_of_an_npz_keeps_the_previous_file(tmp_path):
    path, before = _previous(tmp_path)
    big = np.ones(1 << 16, dtype=np.float32)
    bad = np.array([object()], dtype=object)  # np.save refuses it without pickle, after `big` is written
    with pytest.raises(ValueError):
        write_npz(path, {"mode_0_input": big, "mode_0_output": bad})
    assert path.read_bytes() == before
    assert _leftovers(tmp_path, {"cap.npz"}) == []


def test_failure_at_the_rename_keeps_the_previous_file(tmp_path, monkeypatch):
    path, before = _previous(tmp_path)

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(storage.os, "replace", broken_replace)
    with pytest.raises(OSError):
        write_npz(path, {"mode_0_input": np.zeros(8, dtype=np.float32)})
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert _leftovers(tmp_path, {"cap.npz"}) == []


def test_interrupt_while_writing_json_keeps_the_previous_file(tmp_path, monkeypatch):
    """KeyboardInterrupt is a BaseException: the temporary file must still be removed."""
    from harness.store import files
    path = tmp_path / "cap_stats.json"
    write_json(path, {"a": 1})
    before = path.read_bytes()

    def interrupting_fsync(fd):  # the data is written, the file not yet synced nor renamed
        raise KeyboardInterrupt

    monkeypatch.setattr(files.os, "fsync", interrupting_fsync)
    with pytest.raises(KeyboardInterrupt):
        write_json(path, {"a": 2})
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert _leftovers(tmp_path, {"cap_stats.json"}) == []


def test_successful_write_replaces_the_file_completely(tmp_path):
    path, _ = _previous(tmp_path)
    write_npz(path, {"mode_1_input": np.full(3, 7, dtype=np.int64)})
    with np.load(path) as z:
        assert z.files == ["mode_1_input"] and z["mode_1_input"].tolist() == [7, 7, 7]
    write_json(tmp_path / "s.json", {"x": float("nan"), "y": [float("inf"), -float("inf")]})
    assert json.loads((tmp_path / "s.json").read_text()) == {"x": None, "y": [float("inf"), -float("inf")]}
    assert _leftovers(tmp_path, {"cap.npz", "s.json"}) == []


def test_npz_bytes_do_not_depend_on_the_time(tmp_path):
    """Zip entries carry a fixed date: writing the same arrays twice gives the same bytes."""
    arrays = {"mode_0_input": np.arange(5, dtype=np.float32), "token_ids": np.arange(3)}
    write_npz(tmp_path / "a.npz", arrays)
    write_npz(tmp_path / "b.npz", arrays, compress=False)
    assert (tmp_path / "a.npz").read_bytes() == (tmp_path / "b.npz").read_bytes()
    write_npz(tmp_path / "c.npz", arrays, compress=True)
    with np.load(tmp_path / "c.npz") as z:
        assert z["mode_0_input"].tolist() == [0, 1, 2, 3, 4]
    assert (tmp_path / "c.npz").stat().st_size != (tmp_path / "a.npz").stat().st_size


def test_temporary_file_is_hidden_next_to_the_target(tmp_path, monkeypatch):
    """The partial file is a dot-file with a .tmp suffix in the target's directory (same file system, so the
    rename is atomic, and never mistaken for a capture)."""
    seen = []
    real = storage.os.replace
    monkeypatch.setattr(storage.os, "replace", lambda src, dst: (seen.append((src, dst)), real(src, dst)))
    write_npz(tmp_path / "cap.npz", {"mode_0_input": np.zeros(2, dtype=np.float32)})
    (src, dst), = seen
    src = os.path.basename(src)
    assert os.path.dirname(seen[0][0]) == str(tmp_path) and src.startswith(".cap.npz.") and src.endswith(".tmp")
