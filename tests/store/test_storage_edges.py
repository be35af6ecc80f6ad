"""Storage details: key parsing, paths, JSON safety, space checks, the loader's errors and mode order."""
import json

import numpy as np
import pytest

from harness.store.format import StorageError, check_writable, json_safe, parse_array_key, stats_path, tensor_name, write_json, write_npz
from harness.store.reader import load_capture


@pytest.mark.parametrize("key, parsed", [
    ("mode_0_input", ("0", "input")), ("mode_2-4_residual", ("2-4", "residual")),
    ("mode_k32__L3.ssm.state", ("k32", "L3.ssm.state")), ("mode_0_other", None), ("mode__input", None),
    ("mode_a_b_input", None), ("mode_0__x.y", None), ("xmode_0_input", None), ("mode_0_inputs", None),
])
def test_parse_array_key(key, parsed):
    assert parse_array_key(key) == parsed


def test_names_and_paths():
    assert tensor_name("L0.block.in") == "input" and tensor_name("L0.block.residual") == "residual"
    assert tensor_name("L1.block.in") == "L1.block.in" and tensor_name("L0.ssm.u") == "L0.ssm.u"
    assert stats_path("cap").name == "cap_stats.json" and stats_path("a/b.npz.bak").name == "b.npz.bak_stats.json"


def test_json_safe_walks_every_container():
    obj = {"a": (1.0, float("inf")), "b": {"c": [float("nan"), -float("inf")]}, "d": "x", "e": 3}
    inf, neg = json_safe(float("inf")), json_safe(-float("inf"))
    assert isinstance(inf, str) and inf != neg and "\x00" in inf  # markers json_text turns into 1e999 / -1e999
    assert json_safe(obj) == {"a": [1.0, inf], "b": {"c": [None, neg]}, "d": "x", "e": 3}


def test_check_writable_refuses_a_directory_and_too_little_space(tmp_path):
    with pytest.raises(StorageError, match="it is a directory"):
        check_writable(tmp_path)
    with pytest.raises(StorageError, match=r"not enough disk space for .*MiB needed"):
        check_writable(tmp_path / "x.npz", 1 << 62)
    check_writable(tmp_path / "x.npz", 1)  # fine


def test_loader_errors(tmp_path):
    with pytest.raises(StorageError, match="does not exist"):
        load_capture(tmp_path / "none.npz")
    write_npz(tmp_path / "c.npz", {"mode_0_output": np.zeros(2, np.float32)})
    stats_path(tmp_path / "c.npz").write_text("[1, 2]")
    with pytest.raises(StorageError, match="does not hold a JSON object"):
        load_capture(tmp_path / "c.npz")
    stats_path(tmp_path / "c.npz").write_text("{not json")
    with pytest.raises(StorageError, match="cannot read"):
        load_capture(tmp_path / "c.npz")
    stats_path(tmp_path / "c.npz").write_text(json.dumps({"aliases": {"mode_1__L0.x": "mode_0__L0.missing"}}))
    cf = load_capture(tmp_path / "c.npz")  # no schema_version: read as version 0
    with pytest.raises(StorageError, match=r"cannot read array mode_1__L0.x"):
        cf.array("1", "L0.x")
    with pytest.raises(StorageError, match="no mode '9' in the file; modes: 0, 1"):
        cf.array("9", "output")


def test_manifest_order_and_metadata(tmp_path):
    arrays = {"mode_a_output": np.zeros(1, np.float32), "mode_b_output": np.ones(1, np.float32),
              "mode_c_output": np.ones(1, np.float32), "token_ids": np.arange(2)}
    write_npz(tmp_path / "o.npz", arrays)
    write_json(stats_path(tmp_path / "o.npz"), {"schema_version": 1, "modes": {
        "c": {"tensors": {"output": {"basis": "original"}}}, "a": {}}})
    cf = load_capture(tmp_path / "o.npz")
    assert cf.modes() == ["c", "a", "b"]          # manifest order first, then the rest in file order
    assert cf.tensor_meta("c", "output") == {"basis": "original"}
    assert cf.tensor_meta("a", "output") == {} and cf.tensor_meta("zz", "output") == {}
    assert cf.tensors("b") == ["output"] and cf.tensors("zz") == []
    write_npz(tmp_path / "p.npz", arrays)
    assert load_capture(tmp_path / "p.npz").tensor_meta("a", "output") == {}   # no manifest


def test_compressed_npz_is_deflated(tmp_path):
    import zipfile
    write_npz(tmp_path / "z.npz", {"mode_0_output": np.zeros(1000, np.float32)}, compress=True)
    with zipfile.ZipFile(tmp_path / "z.npz") as zf:
        info = zf.infolist()[0]
        assert info.compress_type == zipfile.ZIP_DEFLATED and info.date_time == (1980, 1, 1, 0, 0, 0)
    write_npz(tmp_path / "s.npz", {"mode_0_output": np.zeros(1000, np.float32)})
    with zipfile.ZipFile(tmp_path / "s.npz") as zf:
        assert zf.infolist()[0].compress_type == zipfile.ZIP_STORED


def test_entries_carry_zip64_headers(tmp_path):
    """Entries are streamed with force_zip64: without it an array over 4 GiB fails when its entry is closed.
    The local header of every entry carries the zip64 extra field (id 0x0001)."""
    import struct
    write_npz(tmp_path / "z.npz", {"mode_0_output": np.zeros(10, np.float32)})
    raw = (tmp_path / "z.npz").read_bytes()
    assert raw[:4] == b"PK\x03\x04"
    name_len, extra_len = struct.unpack("<HH", raw[26:30])
    extra = raw[30 + name_len:30 + name_len + extra_len]
    assert extra_len > 0 and struct.unpack("<H", extra[:2])[0] == 0x0001


def test_block_io_keys_and_the_capture_path(tmp_path):
    from harness.store.format import array_key
    assert [array_key("0", t) for t in ("input", "output", "residual")] == \
        ["mode_0_input", "mode_0_output", "mode_0_residual"]
    write_npz(tmp_path / "c.npz", {"mode_0_residual": np.zeros(1, np.float32)})
    cf = load_capture(tmp_path / "c.npz")
    assert cf.path == tmp_path / "c.npz" and cf.tensors("0") == ["residual"]


def test_space_message_says_how_much_is_free(tmp_path, monkeypatch):
    import collections
    import harness.store.files as files
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(files.shutil, "disk_usage", lambda p: usage(0, 0, 5 * 2 ** 20))
    with pytest.raises(StorageError, match=r"about 10\.0 MiB needed, 5\.0 MiB free in "):
        check_writable(tmp_path / "x.npz", 10 * 2 ** 20)
    check_writable(tmp_path / "x.npz", 4 * 2 ** 20)   # 4 MiB + 10 % fits in 5 MiB


def test_a_streamed_array_is_refused_when_the_disk_cannot_hold_it(tmp_path, monkeypatch):
    """PairWriter.add checks the free space for each array before writing it (a mutant that checked for
    0 bytes survived); the temporary file is removed and nothing is left beside the output."""
    import collections

    import harness.store.files as files
    from harness.store.format import PairWriter

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(files.shutil, "disk_usage", lambda p: usage(0, 0, 5 * 2 ** 20))
    with pytest.raises(StorageError, match=r"MiB needed, 5\.0 MiB free"):
        with PairWriter(tmp_path / "c.npz") as writer:
            writer.add("small", np.zeros(16, np.float32))
            writer.add("mode_0__big", np.zeros(2 ** 21, np.float32))   # 8 MiB
    assert list(tmp_path.iterdir()) == []


def test_file_kind_names_every_special_file_and_only_those():
    """A mode that is none of the named kinds (a symbolic link's, as lstat gives it) is still refused (a mutant
    that took every such mode for a regular file survived: only regular files and the named kinds were tried)."""
    import stat
    from harness.store.files import file_kind
    assert file_kind(stat.S_IFREG | 0o644) is None
    assert file_kind(stat.S_IFLNK | 0o777) == "not a regular file"
    assert file_kind(stat.S_IFDIR | 0o755) == "a directory" and file_kind(stat.S_IFIFO | 0o600) == "a FIFO"


def test_an_output_path_that_cannot_be_looked_at_is_a_clear_error(tmp_path):
    """stat failing for another reason than a missing file (here a parent that is a file) names the path and the
    reason (a mutant that raised StorageError(None) survived: the user would have read "None")."""
    from harness.store.files import check_output
    (tmp_path / "file.txt").write_text("mine")
    with pytest.raises(StorageError, match=r"cannot write .*file\.txt/out\.npz: Not a directory"):
        check_output(tmp_path / "file.txt" / "out.npz")
    assert (tmp_path / "file.txt").read_text() == "mine"


def test_write_npz_checks_the_space_for_all_its_arrays_before_writing(tmp_path, monkeypatch):
    """write_npz sums the arrays' bytes and refuses before writing anything when the disk lacks them (mutants
    that checked for None, for no bytes or for the 8-byte size of np.asarray(None) per array survived:
    write_npz mutmut 2, 4, 6, 8). 3 + 3 MiB do not fit in 5 MiB free; each alone would."""
    import collections

    import harness.store.files as files

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(files.shutil, "disk_usage", lambda p: usage(0, 0, 5 * 2 ** 20))
    arrays = {"mode_0_input": np.zeros(3 * 2 ** 18, np.float32), "mode_0_output": np.ones(3 * 2 ** 18, np.float32)}
    with pytest.raises(StorageError, match=r"not enough disk space for .*c\.npz: about 6\.0 MiB needed, "
                                           r"5\.0 MiB free"):
        write_npz(tmp_path / "c.npz", arrays)
    assert list(tmp_path.iterdir()) == []
    write_npz(tmp_path / "c.npz", {"mode_0_input": arrays["mode_0_input"]})   # 3 MiB + 10 % fits


def test_write_npz_stops_at_its_fault_point_after_the_first_member(tmp_path, monkeypatch):
    """$QUAMBA_HARNESS_FAULT=write-npz:<signal> sends the signal once the first member is written (the hook that
    tests interrupt a write with); the previous file is kept and no temporary file is left (mutants that called
    fault_point(None) or fault_point("XXwrite-npzXX") survived: _npz_writer mutmut 45, 46)."""
    import signal

    from harness.runtime.guard import FAULT_ENV

    class Stopped(Exception):
        pass

    def handler(signum, frame):
        raise Stopped(signal.Signals(signum).name)

    path = tmp_path / "c.npz"
    write_npz(path, {"mode_0_output": np.zeros(2, np.float32)})
    before = path.read_bytes()
    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        monkeypatch.setenv(FAULT_ENV, "write-stats:USR1, write-npz:USR1")
        with pytest.raises(Stopped, match="SIGUSR1"):
            write_npz(path, {"mode_1_output": np.ones(4, np.float32), "mode_2_output": np.ones(4, np.float32)})
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["c.npz"]
    monkeypatch.setenv(FAULT_ENV, "write-stats:USR1")   # another point: the write goes through
    write_npz(path, {"mode_1_output": np.ones(4, np.float32)})
    with np.load(path) as z:
        assert z.files == ["mode_1_output"]


def test_tensor_meta_of_a_manifest_without_modes_is_empty(tmp_path):
    """A manifest without "modes" (an aliases-only or schema-0 stats file) has no tensor metadata: {} rather than
    an AttributeError (mutants that read a missing "modes" as None survived: tensor_meta mutmut 15, 17)."""
    write_npz(tmp_path / "c.npz", {"mode_0_output": np.zeros(2, np.float32)})
    write_json(stats_path(tmp_path / "c.npz"), {"schema_version": 1, "aliases": {"mode_1__L0.x": "mode_0_output"}})
    cf = load_capture(tmp_path / "c.npz")
    assert cf.manifest == {"schema_version": 1, "aliases": {"mode_1__L0.x": "mode_0_output"}}
    assert cf.tensor_meta("0", "output") == {} and cf.tensor_meta("1", "L0.x") == {}
    assert np.array_equal(cf.array("1", "L0.x"), np.zeros(2, np.float32))


def test_write_pair_stores_by_default_and_deflates_when_asked(tmp_path):
    """write_pair writes stored (uncompressed) members unless compress=True, which it hands to its PairWriter
    (mutants with compress=True as the default, or PairWriter(path, None) / PairWriter(path) dropping the
    argument, survived: write_pair mutmut 1, 11, 13). Both files read back the same arrays."""
    import zipfile

    from harness.store.format import write_pair

    arrays = {"mode_0_output": np.zeros(1000, np.float32), "token_ids": np.arange(4)}
    write_pair(tmp_path / "s.npz", arrays, {"schema_version": 2, "modes": {}})
    write_pair(tmp_path / "z.npz", arrays, {"schema_version": 2, "modes": {}}, compress=True)
    for name, method in (("s.npz", zipfile.ZIP_STORED), ("z.npz", zipfile.ZIP_DEFLATED)):
        with zipfile.ZipFile(tmp_path / name) as zf:
            assert [(i.filename, i.compress_type) for i in zf.infolist()] == \
                [("mode_0_output.npy", method), ("token_ids.npy", method)]
        cf = load_capture(tmp_path / name)
        assert np.array_equal(cf.array("0", "output"), arrays["mode_0_output"])
    assert (tmp_path / "z.npz").stat().st_size < (tmp_path / "s.npz").stat().st_size < 4600


def test_write_pair_checks_the_space_for_all_its_arrays_before_writing(tmp_path, monkeypatch):
    """write_pair refuses before writing anything when the disk lacks room for all its arrays together, even where
    each array alone passes PairWriter.add's own check; the previous pair is untouched (mutants that checked for
    None, for no bytes or for np.asarray(None)'s 8 bytes per array survived: write_pair mutmut 5, 7, 9)."""
    import collections

    import harness.store.files as files
    from harness.store.format import write_pair

    out = tmp_path / "p.npz"
    write_pair(out, {"mode_a_output": np.ones(3, np.float32)}, {"schema_version": 2, "modes": {}})
    before = out.read_bytes(), stats_path(out).read_bytes()
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(files.shutil, "disk_usage", lambda p: usage(0, 0, 5 * 2 ** 20))
    arrays = {"mode_a_output": np.zeros(3 * 2 ** 18, np.float32), "mode_a__L0.ssm.u": np.ones(3 * 2 ** 18, np.float32)}
    with pytest.raises(StorageError, match=r"not enough disk space for .*p\.npz: about 6\.0 MiB needed, "
                                           r"5\.0 MiB free"):
        write_pair(out, arrays, {"schema_version": 2, "modes": {}})
    assert (out.read_bytes(), stats_path(out).read_bytes()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.npz", "p_stats.json"]


def test_a_corrupted_npz_is_refused_with_the_reason(tmp_path):
    """The loader's message names the exception that np.load raised (a mutant that wrote "NoneType" there
    survived: load_capture mutmut 22)."""
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(StorageError, match=r"bad\.npz is not a readable \.npz file \(BadZipFile: File is not a zip "
                                           r"file\)$"):
        load_capture(bad)


def test_a_stats_file_over_the_size_limit_is_refused_with_both_sizes(tmp_path, monkeypatch):
    """A stats file larger than MAX_MANIFEST_BYTES is refused before it is read, with its size and the limit
    (a mutant that raised StorageError(None) survived: read_json mutmut 10)."""
    import harness.store.format as storage

    write_npz(tmp_path / "c.npz", {"mode_0_output": np.zeros(2, np.float32)})
    stats_path(tmp_path / "c.npz").write_text('{"schema_version": 1, "modes": {}}')   # 34 bytes
    monkeypatch.setattr(storage, "MAX_MANIFEST_BYTES", 33)
    with pytest.raises(StorageError, match=r"cannot read .*c_stats\.json: 34 bytes is more than a stats file can be "
                                           r"\(33 bytes\)$"):
        load_capture(tmp_path / "c.npz")
    monkeypatch.setattr(storage, "MAX_MANIFEST_BYTES", 34)   # exactly the limit is fine
    assert load_capture(tmp_path / "c.npz").manifest == {"schema_version": 1, "modes": {}}


@pytest.mark.parametrize("npz", [{"file": "c.npz"}, {"file": "c.npz", "sha256": 12}, "c.npz"])
def test_a_manifest_npz_entry_without_a_sha256_string_is_refused(tmp_path, npz):
    """"npz" must be an object holding the .npz's sha256 as a string; a dict without it is not read as a schema-1
    manifest (mutants that accepted any dict, or set no problem, survived: _check_manifest mutmut 45, 46)."""
    write_npz(tmp_path / "c.npz", {"mode_0_output": np.zeros(2, np.float32)})
    write_json(stats_path(tmp_path / "c.npz"), {"schema_version": 2, "modes": {}, "npz": npz})
    with pytest.raises(StorageError, match=r"c_stats\.json is not a valid stats file: field npz(\.sha256)?: expected "
                                           r"(the field 'sha256'|a string, got an integer|an object, got a string)$"):
        load_capture(tmp_path / "c.npz")


def test_a_pending_manifest_without_npz_does_not_excuse_a_mismatch(tmp_path):
    """A pending manifest (valid, but recording no .npz hash) beside a pair whose hash does not match is not the
    pair's: the mismatch is refused with its reason, not an AttributeError (a mutant that read a missing "npz"
    as None survived: _matching_manifest mutmut 48)."""
    from harness.store.format import pending_path, write_pair

    out = tmp_path / "p.npz"
    write_pair(out, {"mode_a_output": np.ones(3, np.float32)}, {"schema_version": 2, "modes": {}})
    write_npz(out, {"mode_a_output": np.zeros(3, np.float32)})            # the .npz replaced outside a pair
    write_json(pending_path(out), {"schema_version": 2, "modes": {}})
    with pytest.raises(StorageError, match=r"p\.npz does not match .*p_stats\.json: the stats file records an "
                                           r"\.npz with sha256 [0-9a-f]{16}\.\.\., the file has"):
        load_capture(out)


def test_write_pair_writes_the_bytes_write_npz_writes(tmp_path):
    """A pair's .npz, streamed member by member, is byte for byte the file write_npz writes for the same arrays,
    stored or deflated: the same fixed date (1980-01-01), the same zip64 headers (mutants of PairWriter.add that
    dated members 1981-01-01 or 1980-02-01, or dropped force_zip64, survived: add mutmut 26, 27, 35)."""
    import zipfile

    from harness.store.format import write_pair

    arrays = {"mode_0_output": np.arange(12, dtype=np.float32).reshape(1, 3, 4), "token_ids": np.arange(3),
              "model": np.array("m"), "mode_0__L0.ssm.u": np.ones((2, 2), np.float16)}
    for compress in (False, True):
        write_npz(tmp_path / "n.npz", arrays, compress=compress)
        write_pair(tmp_path / "p.npz", arrays, {"schema_version": 2, "modes": {}}, compress=compress)
        assert (tmp_path / "p.npz").read_bytes() == (tmp_path / "n.npz").read_bytes()
        with zipfile.ZipFile(tmp_path / "p.npz") as zf:
            assert {i.date_time for i in zf.infolist()} == {(1980, 1, 1, 0, 0, 0)}


def test_write_pair_refuses_object_arrays_without_pickling(tmp_path):
    """A member is never pickled: an object array is refused with numpy's allow_pickle=False error and the
    previous pair stays (a mutant that wrote with allow_pickle=True survived: PairWriter.add mutmut 47)."""
    from harness.store.format import write_pair

    out = tmp_path / "p.npz"
    write_pair(out, {"mode_a_output": np.ones(3, np.float32)}, {"schema_version": 2, "modes": {}})
    before = out.read_bytes(), stats_path(out).read_bytes()
    with pytest.raises(ValueError, match="Object arrays cannot be saved when allow_pickle=False"):
        write_pair(out, {"mode_a_output": np.array([{"a": 1}], dtype=object)}, {"schema_version": 2, "modes": {}})
    assert (out.read_bytes(), stats_path(out).read_bytes()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.npz", "p_stats.json"]


def test_pair_writer_dedups_only_when_asked(tmp_path):
    """PairWriter stores every array unless dedup=True, and write_pair never dedups (a mutant with dedup=True
    as the default survived: PairWriter.__init__ mutmut 2)."""
    from harness.store.format import PairWriter, write_pair

    a = np.arange(4, dtype=np.float32)
    arrays = {"mode_a__L0.ssm.u": a, "mode_b__L0.ssm.u": a.copy()}
    write_pair(tmp_path / "w.npz", arrays, {"schema_version": 2, "modes": {}})
    with PairWriter(tmp_path / "p.npz") as writer:
        for key, arr in arrays.items():
            writer.add(key, arr)
        writer.commit({"schema_version": 2, "modes": {}})
    assert writer.aliases == {} and writer.keys == ["mode_a__L0.ssm.u", "mode_b__L0.ssm.u"]
    for name in ("w.npz", "p.npz"):
        with np.load(tmp_path / name) as z:
            assert z.files == ["mode_a__L0.ssm.u", "mode_b__L0.ssm.u"]
    with PairWriter(tmp_path / "d.npz", dedup=True) as writer:
        for key, arr in arrays.items():
            writer.add(key, arr)
        writer.commit({"schema_version": 2, "modes": {}})
    assert writer.aliases == {"mode_b__L0.ssm.u": "mode_a__L0.ssm.u"} and writer.keys == ["mode_a__L0.ssm.u"]


def _failing_replace(monkeypatch, fails):
    """os.replace (as storage calls it) raising ENOSPC for the rename that `fails(src, dst)` picks."""
    import harness.store.format as storage
    real = storage.os.replace

    def replace(src, dst):
        if fails(str(src), str(dst)):
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(storage.os, "replace", replace)


def test_a_commit_that_fails_before_the_npz_rename_leaves_the_old_pair_and_no_pending_manifest(tmp_path, monkeypatch):
    """The pending manifest is written, then renaming the .npz into place fails: the pending manifest is removed
    with the temporary files and the old pair is read as before (mutants that started with npz_renamed = True, or
    removed the pending manifest only after the rename, survived: PairWriter.commit mutmut 14, 46)."""
    from harness.store.format import write_pair

    out = tmp_path / "p.npz"
    write_pair(out, {"mode_a_output": np.ones(3, np.float32)}, {"schema_version": 2, "modes": {}, "run": "old"})
    before = out.read_bytes(), stats_path(out).read_bytes()
    _failing_replace(monkeypatch, lambda src, dst: dst == str(out))
    with pytest.raises(OSError, match="No space left on device"):
        write_pair(out, {"mode_a_output": np.zeros(3, np.float32)}, {"schema_version": 2, "modes": {}, "run": "new"})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.npz", "p_stats.json"]
    assert (out.read_bytes(), stats_path(out).read_bytes()) == before
    assert load_capture(out).manifest["run"] == "old"


def test_a_commit_that_fails_between_the_renames_keeps_the_pending_manifest(tmp_path, monkeypatch):
    """The .npz is renamed into place, then renaming the pending manifest over _stats.json fails: the pending
    manifest is kept (it is the only record of the new .npz's hash) and the loader reads the new pair through it
    (a mutant that set npz_renamed = None after the rename, so the pending manifest was removed, survived:
    PairWriter.commit mutmut 34)."""
    from harness.store.format import pending_path, write_pair

    out = tmp_path / "p.npz"
    write_pair(out, {"mode_a_output": np.ones(3, np.float32)}, {"schema_version": 2, "modes": {}, "run": "old"})
    _failing_replace(monkeypatch, lambda src, dst: src == str(pending_path(out)))
    with pytest.raises(OSError, match="No space left on device"):
        write_pair(out, {"mode_a_output": np.zeros(3, np.float32)}, {"schema_version": 2, "modes": {}, "run": "new"})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".p_stats.json.pending", "p.npz", "p_stats.json"]
    cf = load_capture(out)
    assert cf.manifest["run"] == "new" and cf.array("a", "output").tolist() == [0.0, 0.0, 0.0]


def test_a_stats_write_that_fails_leaves_no_temporary_stats_file(tmp_path, monkeypatch):
    """Writing the new manifest fails half-way (disk full): the temporary stats file goes with the rest and the
    old pair is read as before (a mutant that removed nothing there survived: PairWriter.commit mutmut 46)."""
    import errno

    import harness.store.format as fmt
    from harness.store.format import write_pair

    out = tmp_path / "p.npz"
    write_pair(out, {"mode_a_output": np.ones(3, np.float32)}, {"schema_version": 2, "modes": {}, "run": "old"})
    before = out.read_bytes(), stats_path(out).read_bytes()

    def half_written(tmp, write, fault=None):
        with open(tmp, "wb") as f:
            f.write(b'{"schema')
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(fmt, "write_file", half_written)
    with pytest.raises(OSError, match="No space left on device"):
        write_pair(out, {"mode_a_output": np.zeros(3, np.float32)}, {"schema_version": 2, "modes": {}, "run": "new"})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.npz", "p_stats.json"]
    assert (out.read_bytes(), stats_path(out).read_bytes()) == before
