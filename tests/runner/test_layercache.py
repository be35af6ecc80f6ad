"""runner.layercache: the one per-layer cache of every recipe. Entries round-trip bit for bit; a write is atomic and
leaves no temporary file, even when it fails; every file that is not a valid entry for its key (edited, truncated,
renamed, of another kind or version, a FIFO or a directory, too large, a pickle, nested too deep) is refused with
its reason, never used."""
import json
import os
import threading

import numpy as np
import pytest

import harness.runner.layercache as layercache
from harness.runner.layercache import VERSION, BadEntry, LayerCache

KEY = "ab" * 32


def _arrays():
    f32 = np.array([1.5, -0.0, np.nan, np.inf, 3e-45], dtype=np.float32)
    return {"f32": f32, "f16": np.arange(12, dtype=np.float16).reshape(3, 4) / 7, "u8": np.arange(256, dtype=np.uint8),
            "i64": np.array([-(2 ** 62), 7]), "flag": np.array([True, False]), "scalar": np.array(2.5),
            "empty": np.zeros((0, 3), np.int32), "be": np.array([1.25, 2.0], dtype=">f8"),
            "strided": np.arange(20, dtype=np.int16).reshape(4, 5)[:, ::2]}


def _members(path):
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def _header(path):
    return json.loads(_members(path)["__entry__"].tobytes())


def _rewrite(path, header=None, **arrays):
    """The entry at `path` with its header and arrays replaced (the checksum left as it was unless given)."""
    members = _members(path)
    members.update(arrays)
    if header is not None:
        members["__entry__"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    np.savez(path, **members)


def _leftovers(directory):
    return sorted(p.name for p in directory.iterdir() if not p.name.endswith(f".v{VERSION}.npz"))


def test_an_entry_round_trips_bit_for_bit(tmp_path):
    cache = LayerCache(tmp_path / "a" / "b", "calib")  # made on first write, with its parents
    payload = {"scales": {"s_in": 0.1 + 0.2, "tiny": 5e-324}, "layer": 3, "observers": [{"amax": 1 / 3}], "none": None}
    path = cache.write(KEY, payload, _arrays())
    assert path == tmp_path / "a" / "b" / f"calib-{KEY[:40]}.v{VERSION}.npz"
    entry = cache.read(KEY)
    assert entry.key == KEY and entry.payload == payload
    assert set(entry.arrays) == set(_arrays())
    for name, want in _arrays().items():
        got = entry.arrays[name]
        assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == np.ascontiguousarray(want).tobytes()
    assert cache.write(KEY, {"x": 1}) == path and cache.read(KEY).arrays == {}  # no arrays: the header alone
    assert _leftovers(tmp_path / "a" / "b") == []


def test_no_file_is_none_and_no_cache_reads_nothing(tmp_path):
    assert LayerCache(tmp_path, "calib").read(KEY) is None
    (tmp_path / "file").write_text("x")
    assert LayerCache(tmp_path / "file" / "cache", "calib").read(KEY) is None  # its directory cannot exist
    (tmp_path / f"calib-{KEY[:40]}.json").write_text("{}")                    # the caches of before: not found
    (tmp_path / f"gptq-{KEY[:40]}.npz").write_bytes(b"PK")
    assert LayerCache(tmp_path, "calib").read(KEY) is None and LayerCache(tmp_path, "gptq").read(KEY) is None
    off = LayerCache(None, "calib")
    assert not off.enabled and off.read_layers([KEY], lambda i, e: e, "cache file") == ([], [])


@pytest.mark.parametrize("where", ["savez", "fsync", "replace"])
def test_a_failed_write_leaves_the_old_entry_and_no_temporary_file(tmp_path, monkeypatch, where):
    cache = LayerCache(tmp_path, "gptq")
    cache.write(KEY, {"old": True}, {"a": np.zeros(3)})
    before = cache.path(KEY).read_bytes()

    def partial_savez(f, **members):
        f.write(b"PK\x03\x04 half an entry")
        raise OSError(28, "No space left on device")

    def boom(*_a):
        raise OSError(5, "Input/output error")

    target = {"savez": (layercache.np, "savez", partial_savez), "fsync": (os, "fsync", boom),
              "replace": (os, "replace", boom)}[where]
    monkeypatch.setattr(*target)
    with pytest.raises(OSError):
        cache.write(KEY, {"old": False}, {"a": np.ones(3)})
    monkeypatch.undo()
    assert cache.path(KEY).read_bytes() == before and cache.read(KEY).payload == {"old": True}
    assert _leftovers(tmp_path) == []


def test_an_interrupted_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    """A KeyboardInterrupt (Ctrl-C) in the middle of a write: no entry and no temporary file."""
    cache = LayerCache(tmp_path, "calib")

    def interrupted(f, **members):
        f.write(b"PK")
        raise KeyboardInterrupt

    monkeypatch.setattr(layercache.np, "savez", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cache.write(KEY, {"x": 1})
    assert list(tmp_path.iterdir()) == []


def test_an_edited_payload_or_array_fails_the_checksum(tmp_path):
    cache = LayerCache(tmp_path, "gptq")
    path = cache.write(KEY, {"scale": 0.5}, {"codes": np.arange(6, dtype=np.uint8)})
    header = _header(path)
    _rewrite(path, {**header, "payload": {"scale": 0.25}})
    with pytest.raises(BadEntry, match=r"^checksum mismatch \(the file was modified or truncated\)$"):
        cache.read(KEY)
    cache.write(KEY, {"scale": 0.5}, {"codes": np.arange(6, dtype=np.uint8)})
    _rewrite(path, codes=np.array([1, 1, 2, 3, 4, 5], np.uint8))  # one bit of one code
    with pytest.raises(BadEntry, match="^checksum mismatch"):
        cache.read(KEY)
    cache.write(KEY, {"scale": 0.5}, {"codes": np.arange(6, dtype=np.uint8)})
    _rewrite(path, extra=np.zeros(1))                              # a member the header does not name
    with pytest.raises(BadEntry, match="^checksum mismatch"):
        cache.read(KEY)
    members = _members(cache.write(KEY, {"scale": 0.5}, {"codes": np.arange(6, dtype=np.uint8)}))
    np.savez(path, __entry__=members["__entry__"])                # a member dropped
    with pytest.raises(BadEntry, match="^checksum mismatch"):
        cache.read(KEY)


@pytest.mark.parametrize("cut", [0.2, 0.5, 0.9, 0.999])
def test_a_truncated_entry_is_refused(tmp_path, cut):
    cache = LayerCache(tmp_path, "gptq")
    path = cache.write(KEY, {"scale": 0.5}, {"codes": np.arange(4096, dtype=np.uint8) % 16})
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * cut)])
    with pytest.raises(BadEntry, match=r"^unreadable \(BadZipFile: "):
        cache.read(KEY)
    path.write_bytes(b"")
    with pytest.raises(BadEntry, match=r"^not a cache entry \(not an .npz file\)$"):
        cache.read(KEY)


def test_another_key_kind_or_version_is_refused(tmp_path):
    other = "cd" * 32
    calib = LayerCache(tmp_path, "calib")
    calib.write(other, {"x": 1})
    os.replace(calib.path(other), calib.path(KEY))                 # renamed under another key's name
    with pytest.raises(BadEntry, match="^key mismatch$"):
        calib.read(KEY)
    os.replace(LayerCache(tmp_path, "gptq").write(KEY, {"x": 1}), calib.path(KEY))
    with pytest.raises(BadEntry, match=r"^kind mismatch \(a 'gptq' entry, not 'calib'\)$"):
        calib.read(KEY)
    path = calib.write(KEY, {"x": 1})
    header = _header(path)
    body = {k: v for k, v in header.items() if k != "checksum"}
    body["version"] = VERSION + 1
    _rewrite(path, {**body, "checksum": layercache._digest(body, {})})
    with pytest.raises(BadEntry, match=rf"^version {VERSION + 1}, this harness reads version {VERSION}$"):
        calib.read(KEY)
    body = {**body, "version": VERSION, "format": "something else"}
    _rewrite(path, {**body, "checksum": layercache._digest(body, {})})
    with pytest.raises(BadEntry, match=r"^not a cache entry \(another format\)$"):
        calib.read(KEY)
    with open(path, "wb") as f:
        np.save(f, np.zeros(3))  # an .npy, not an .npz
    with pytest.raises(BadEntry, match=r"^not a cache entry \(not an .npz file\)$"):
        calib.read(KEY)


def test_a_fifo_or_a_directory_at_the_path_is_refused_without_blocking(tmp_path):
    cache = LayerCache(tmp_path, "calib")
    os.mkfifo(cache.path(KEY))
    got = []
    reader = threading.Thread(target=lambda: got.append(pytest.raises(BadEntry, cache.read, KEY)), daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "reading a FIFO blocked"
    assert str(got[0].value) == "it is a FIFO, not a regular file"
    os.unlink(cache.path(KEY))
    cache.path(KEY).mkdir()
    with pytest.raises(BadEntry, match="^it is a directory, not a regular file$"):
        cache.read(KEY)
    with pytest.raises(OSError):  # a directory is never replaced; the caller reports it
        cache.write(KEY, {"x": 1})
    assert _leftovers(tmp_path) == []


def test_too_large_a_file_or_member_is_refused_unread(tmp_path):
    cache = LayerCache(tmp_path, "calib", max_bytes=1 << 16)
    path = cache.path(KEY)
    path.write_bytes(b"PK\x03\x04" + b" " * (1 << 16))
    with pytest.raises(BadEntry, match=f"^it is larger than {1 << 16} bytes$"):
        cache.read(KEY)
    big = LayerCache(tmp_path, "calib", max_bytes=1 << 30)
    big.write(KEY, {"x": 1}, {"zeros": np.zeros(1 << 20, np.uint8)})
    np.savez_compressed(path, **_members(path))  # a few KB on disk, 1 MiB unpacked
    assert path.stat().st_size < 1 << 16
    with pytest.raises(BadEntry, match=f"^its members hold more than {1 << 16} bytes"):
        cache.read(KEY)
    assert big.read(KEY).arrays["zeros"].shape == (1 << 20,)


def test_a_pickle_is_never_loaded(tmp_path):
    cache = LayerCache(tmp_path, "calib")
    path = cache.write(KEY, {"x": 1}, {"a": np.zeros(2)})
    members = _members(path)
    np.savez(path, __entry__=members["__entry__"], a=np.array([{"evil": 1}, None], dtype=object))
    with pytest.raises(BadEntry, match=r"^unreadable \(ValueError: .*allow_pickle"):
        cache.read(KEY)
    with pytest.raises(ValueError, match="cannot cache array 'o' of dtype object"):
        cache.write(KEY, {}, {"o": np.array([None], dtype=object)})


def test_a_header_nested_too_deep_is_a_bad_entry(tmp_path):
    cache = LayerCache(tmp_path, "calib")
    deep = "[" * 50_000 + "]" * 50_000
    np.savez(cache.path(KEY), __entry__=np.frombuffer(deep.encode(), np.uint8))
    with pytest.raises(BadEntry, match=r"^nested too deeply to be a cache entry \(RecursionError\)$"):
        cache.read(KEY)
    np.savez(cache.path(KEY), __entry__=np.frombuffer(b"\xff{", np.uint8))
    with pytest.raises(BadEntry, match=r"^unreadable \(UnicodeDecodeError: "):
        cache.read(KEY)


def test_read_layers_stops_at_the_first_missing_or_bad_layer(tmp_path):
    cache = LayerCache(tmp_path, "calib")
    keys = [f"{i:x}" * 64 for i in range(4)]
    for i in (0, 1, 3):
        cache.write(keys[i], {"layer": i})
    parse = lambda i, e: e.payload["layer"]  # noqa: E731
    assert cache.read_layers(keys, parse, "cache file") == ([0, 1], [])            # layer 2 missing
    cache.path(keys[1]).write_text("{ truncated")
    assert cache.read_layers(keys, parse, "cache file") == \
        ([0], [f"layer 1 cache file {cache.path(keys[1])} is corrupted: not a cache entry (not an .npz file)"])

    def refuse(i, e):
        raise ValueError(f"layer {i} does not fit")

    assert cache.read_layers(keys, refuse, "GPTQ cache file")[1] == \
        [f"layer 0 GPTQ cache file {cache.path(keys[0])} is corrupted: layer 0 does not fit"]
    assert cache.write_layers(keys[:2], [({"layer": 7}, None), ({"layer": 8}, {"a": np.ones(1)})]) == \
        [str(cache.path(k)) for k in keys[:2]]
    assert cache.read_layers(keys[:2], parse, "cache file") == ([7, 8], [])


@pytest.mark.parametrize("kind", ["", "a/b"])
def test_a_kind_is_a_file_name_part(tmp_path, kind):
    with pytest.raises(ValueError, match="a cache kind is a non-empty name"):
        LayerCache(tmp_path, kind)
