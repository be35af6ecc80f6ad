import json

import numpy as np
import pytest

from harness.store.format import StorageError, array_key, dedup_arrays, parse_array_key, stats_path, write_json, write_npz
from harness.store.reader import load_capture


def test_keys_round_trip():
    assert array_key("2-0", "output") == "mode_2-0_output"
    assert array_key("2-4", "L0.ssm.u") == "mode_2-4__L0.ssm.u"
    assert parse_array_key("mode_2-4__L0.ssm.u") == ("2-4", "L0.ssm.u")
    assert parse_array_key("mode_fp32_input") == ("fp32", "input")
    assert parse_array_key("token_ids") is None
    assert stats_path("x/first.npz").name == "first_stats.json"


def test_npz_loads_without_pickle_and_is_byte_reproducible(tmp_path):
    arrays = {"mode_0_output": np.arange(6, dtype=np.float32).reshape(1, 2, 3), "model": np.array("m"),
              "seq_len": np.array(2)}
    write_npz(tmp_path / "a.npz", arrays)
    write_npz(tmp_path / "b.npz", arrays)
    assert (tmp_path / "a.npz").read_bytes() == (tmp_path / "b.npz").read_bytes()
    with np.load(tmp_path / "a.npz", allow_pickle=False) as z:
        assert np.array_equal(z["mode_0_output"], arrays["mode_0_output"]) and str(z["model"]) == "m"


def test_failed_write_leaves_nothing_behind(tmp_path):
    class Boom:
        def __array__(self, *a, **k):
            raise RuntimeError("cannot serialize")

        nbytes = 0

    with pytest.raises(RuntimeError):
        write_npz(tmp_path / "x.npz", {"a": np.zeros(3), "b": Boom()})
    assert list(tmp_path.iterdir()) == []


def test_unwritable_target_is_a_clear_error(tmp_path):
    with pytest.raises(StorageError, match="does not exist"):
        write_npz(tmp_path / "missing" / "x.npz", {"a": np.zeros(1)})


def test_dedup_and_alias_resolution(tmp_path):
    a = np.ones((1, 2), np.float32)
    arrays = {"mode_0_output": a, "mode_0__L0.out_proj.out": a.copy(), "mode_2-0__L0.ssm.u": a + 1,
              "mode_2-1__L0.ssm.u": a + 1}
    kept, aliases = dedup_arrays(arrays)
    assert aliases == {"mode_0__L0.out_proj.out": "mode_0_output", "mode_2-1__L0.ssm.u": "mode_2-0__L0.ssm.u"}
    write_npz(tmp_path / "c.npz", kept)
    write_json(stats_path(tmp_path / "c.npz"), {"schema_version": 1, "aliases": aliases, "modes": {}})
    cf = load_capture(tmp_path / "c.npz")
    assert np.array_equal(cf.array("2-1", "L0.ssm.u"), a + 1)
    assert cf.tensors("0") == ["output", "L0.out_proj.out"]


def test_research_tool_file_is_read(tmp_path):
    np.savez_compressed(tmp_path / "old.npz", timestamp=np.array("2025-11-10"), model=np.array("quamba-130m-w8a8"),
                        seq_len=np.array(512), mode_fp32_input=np.zeros((1, 4, 8), np.float32),
                        mode_fp32_output=np.ones((1, 4, 8), np.float32), **{"mode_2-0_output": np.ones((1, 4, 8), np.float32)})
    cf = load_capture(tmp_path / "old.npz")
    assert cf.manifest is None and set(cf.modes()) == {"fp32", "2-0"}


def test_corrupted_and_unknown_versions_are_rejected(tmp_path):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(StorageError, match="not a readable .npz"):
        load_capture(bad)
    write_npz(tmp_path / "v.npz", {"mode_0_output": np.zeros(2, np.float32)})
    stats_path(tmp_path / "v.npz").write_text(json.dumps({"schema_version": 99}))
    with pytest.raises(StorageError, match="schema_version 99 is not supported; supported: 0, 1, 2, 3"):
        load_capture(tmp_path / "v.npz")


def _strict(text: str):
    """Parse as strict JSON: the tokens Infinity, -Infinity and NaN are refused."""
    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")
    return json.loads(text, parse_constant=refuse)


def test_json_writes_non_finite_as_numbers_that_numpy_users_compare(tmp_path):
    """Schema 3: infinities are the JSON numbers 1e999 / -1e999 (read back as inf, comparable), NaN is null;
    the file is strict JSON (no Infinity/NaN tokens, no strings for numbers)."""
    write_json(tmp_path / "s.json", {"a": float("inf"), "b": [float("nan"), -float("inf"), 1.5], "c": "inf"})
    text = (tmp_path / "s.json").read_text()
    data = _strict(text)
    assert data == {"a": float("inf"), "b": [None, -float("inf"), 1.5], "c": "inf"}
    assert data["a"] == np.inf and np.isinf(data["b"][1]) and data["b"][1] < 0
    assert '"a": 1e999' in text and "-1e999" in text and "null" in text


def test_write_pair_is_all_or_nothing(tmp_path):
    from harness.store.format import write_pair

    out = tmp_path / "p.npz"
    stats = write_pair(out, {"mode_a_output": np.ones(3, np.float32)}, {"schema_version": 2, "modes": {}})
    assert stats["npz"]["sha256"] == __import__("hashlib").sha256(out.read_bytes()).hexdigest()
    before = out.read_bytes(), stats_path(out).read_bytes()

    class Boom:
        def __array__(self, *a, **k):
            raise RuntimeError("cannot serialize")

        nbytes = 0

    with pytest.raises(RuntimeError):
        write_pair(out, {"mode_a_output": np.zeros(3, np.float32), "b": Boom()}, {"schema_version": 2, "modes": {}})
    assert (out.read_bytes(), stats_path(out).read_bytes()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.npz", "p_stats.json"]
    assert np.array_equal(load_capture(out).array("a", "output"), np.ones(3, np.float32))


def test_a_pair_killed_between_its_renames_is_read_through_the_pending_manifest(tmp_path):
    """The .npz was renamed into place, the stats were not: the pending manifest, whose sha256 matches the new
    .npz, is the pair's (in process; mutants that broke this check survived where only the subprocess fault
    tests reach it). A pending manifest that does not match is not taken."""
    import shutil

    from harness.store.reader import load_capture
    from harness.store.format import pending_path, write_pair

    old, new = tmp_path / "p.npz", tmp_path / "new" / "p.npz"
    new.parent.mkdir()
    write_pair(old, {"mode_a_output": np.ones(3, np.float32)}, {"schema_version": 2, "modes": {}, "run": "old"})
    write_pair(new, {"mode_a_output": np.full(3, 2.0, np.float32)}, {"schema_version": 2, "modes": {}, "run": "new"})
    shutil.copy(stats_path(new), pending_path(old))       # the pending manifest written,
    shutil.copy(new, old)                                  # the first rename done, the second not
    cf = load_capture(old)
    assert cf.manifest["run"] == "new" and float(cf.npz["mode_a_output"][0]) == 2.0
    pending_path(old).write_text(stats_path(old).read_text())   # a pending manifest of the old .npz
    with pytest.raises(StorageError, match=r"does not match .* sha256 [0-9a-f]{16}\.\.\., the file has [0-9a-f]{16}\.\.\. "):
        load_capture(old)
