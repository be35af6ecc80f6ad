"""Deduplication of identical tap arrays: equal arrays share storage, anything that differs never does."""
import numpy as np
import pytest

from harness.store.format import dedup_arrays, write_npz
from harness.store.reader import load_capture


def test_identical_tap_arrays_are_stored_once():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    kept, aliases = dedup_arrays({"mode_0__L0.ssm.u": a, "mode_2-0__L0.ssm.u": a.copy(), "mode_2-1__L0.ssm.u": a.copy()})
    assert list(kept) == ["mode_0__L0.ssm.u"]
    assert aliases == {"mode_2-0__L0.ssm.u": "mode_0__L0.ssm.u", "mode_2-1__L0.ssm.u": "mode_0__L0.ssm.u"}


@pytest.mark.parametrize("other", [
    pytest.param(np.zeros(4, dtype=np.int32), id="same bytes, other dtype"),
    pytest.param(np.zeros((2, 2), dtype=np.float32), id="same bytes, other shape"),
    pytest.param(np.array([0.0, 0.0, 0.0, 1e-45], dtype=np.float32), id="one element differs (by one ulp)"),
    pytest.param(np.array([0.0, 0.0, 0.0, -0.0], dtype=np.float32), id="signed zero"),
    pytest.param(np.zeros(4, dtype=">f4"), id="other byte order"),
])
def test_arrays_that_differ_are_never_aliased(other):
    base = np.zeros(4, dtype=np.float32)
    kept, aliases = dedup_arrays({"mode_0__L0.ssm.u": base, "mode_1__L0.ssm.u": other})
    assert aliases == {}
    assert set(kept) == {"mode_0__L0.ssm.u", "mode_1__L0.ssm.u"}
    assert kept["mode_1__L0.ssm.u"].dtype == other.dtype and kept["mode_1__L0.ssm.u"].shape == other.shape


def test_block_io_arrays_are_always_stored():
    """Only tap keys ("__") may become aliases; the research tool's keys must exist in the .npz itself."""
    a = np.ones(3, dtype=np.float32)
    kept, aliases = dedup_arrays({"mode_0_input": a, "mode_1_input": a.copy(), "mode_1__L0.ssm.u": a.copy()})
    assert list(kept) == ["mode_0_input", "mode_1_input"]
    assert aliases == {"mode_1__L0.ssm.u": "mode_0_input"}


def test_alias_points_at_the_first_stored_copy():
    a, b = np.ones(3, dtype=np.float32), np.zeros(3, dtype=np.float32)
    kept, aliases = dedup_arrays({"mode_0__L0.a": a, "mode_0__L0.b": b, "mode_1__L0.a": a.copy(),
                                  "mode_1__L0.b": b.copy()})
    assert aliases == {"mode_1__L0.a": "mode_0__L0.a", "mode_1__L0.b": "mode_0__L0.b"}
    assert list(kept) == ["mode_0__L0.a", "mode_0__L0.b"]


def test_round_trip_resolves_aliases(tmp_path):
    a = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    b = a.copy()
    b[1, 2] = np.nextafter(b[1, 2], np.float32(2))
    arrays = {"mode_0_input": a, "mode_0__L0.ssm.u": a.copy(), "mode_1__L0.ssm.u": b, "mode_2-4__L0.ssm.u": a.copy()}
    kept, aliases = dedup_arrays(arrays)
    path = tmp_path / "cap.npz"
    write_npz(path, kept)
    (tmp_path / "cap_stats.json").write_text('{"schema_version": 1, "aliases": %s}' % str(aliases).replace("'", '"'))
    cf = load_capture(path)
    for key, arr in arrays.items():
        mode, tensor = key[len("mode_"):].split("_", 1)
        tensor = tensor.lstrip("_")
        got = cf.array(mode, tensor)
        assert got.dtype == arr.dtype and np.array_equal(got, arr), key
    with np.load(path) as z:
        assert sorted(z.files) == ["mode_0_input", "mode_1__L0.ssm.u"]
