"""compare_modes, identical_groups, same_basis and input_tensor_for on hand-made arrays."""
import numpy as np
import pytest

from harness.metrics.compare import CompareError, compare_modes, identical_groups, input_tensor_for, same_basis


def _arrays():
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    y = x + np.float32(0.25)
    return {
        "fp32": {"input": x, "output": y, "L1.block.in": y, "L1.ssm.u": x},
        "a": {"input": x, "output": y, "L1.block.in": y, "L1.ssm.u": x},          # identical to fp32
        "b": {"input": x, "output": y * 2, "L1.block.in": y * 2, "L1.ssm.u": x},  # differs from layer 0's output on
        "c": {"input": x + 1, "output": y, "extra": x, "L1.ssm.u": x[:2]},       # other input, other shape
    }


def _compare(arrays, reference="fp32", comparable=None):
    return compare_modes({m: list(t) for m, t in arrays.items()}, lambda m, t: arrays[m][t], reference, comparable)


def test_rows_skips_and_flags():
    arrays = _arrays()
    out = _compare(arrays)
    assert out["reference"] == "fp32" and list(out["modes"]) == ["a", "b", "c"]
    a, b, c = (out["modes"][m] for m in "abc")
    assert all(row["identical"] and row["mse"] == 0.0 for row in a.values())
    assert a["output"]["input_differs"] is False and a["L1.ssm.u"]["input_differs"] is False
    assert b["output"]["identical"] is False and b["output"]["input_differs"] is False
    assert b["L1.ssm.u"]["identical"] is True and b["L1.ssm.u"]["input_differs"] is True   # L1's input is L1.block.in
    assert c["output"]["input_differs"] is True and c["output"]["identical"] is True
    assert c["input"]["input_differs"] is True and c["input"]["identical"] is False
    assert out["skipped"] == {"c": {"extra": "not captured in the reference",
                                    "L1.ssm.u": "shape [2, 4] differs from the reference's [3, 4]"}}
    assert b["output"]["max_abs"] == pytest.approx(float(np.abs(arrays["b"]["output"] - arrays["fp32"]["output"]).max()))


def test_input_differs_is_absent_when_the_input_was_not_captured():
    x = np.ones(3, dtype=np.float32)
    arrays = {"fp32": {"L2.ssm.u": x}, "a": {"L2.ssm.u": x + 1}}
    row = _compare(arrays)["modes"]["a"]["L2.ssm.u"]
    assert "input_differs" not in row and row["identical"] is False


def test_comparable_rule_skips_with_its_reason():
    arrays = _arrays()
    basis = {("fp32", "output"): "original", ("a", "output"): "rotated"}
    rule = same_basis(lambda m, t: basis.get((m, t)), "fp32")
    out = _compare({"fp32": arrays["fp32"], "a": arrays["a"]}, comparable=rule)
    assert out["skipped"] == {"a": {"output": "basis differs (rotated vs original)"}}
    assert set(out["modes"]["a"]) == {"input", "L1.block.in", "L1.ssm.u"}
    assert rule("a", "input") is None


def test_unknown_reference_lists_the_modes():
    with pytest.raises(CompareError, match="reference mode 'x' is not in the file; modes present: fp32, a, b, c; "
                                           "choose one with --reference fp32"):
        _compare(_arrays(), reference="x")
    with pytest.raises(CompareError, match="modes present: none"):
        compare_modes({}, lambda m, t: None, "fp32")


def test_identical_groups_need_every_shared_tensor_equal():
    arrays = _arrays()
    get = lambda m, t: arrays[m][t]  # noqa: E731
    groups = identical_groups({m: list(t) for m, t in arrays.items()}, get)
    assert groups == [["fp32", "a"]]       # b differs in output, c in input; singletons are not groups
    arrays["d"] = {"zzz": np.zeros(1)}     # shares no tensor with anyone: never grouped
    arrays["e"] = dict(arrays["b"])
    groups = identical_groups({m: list(t) for m, t in arrays.items()}, get)
    assert groups == [["fp32", "a"], ["b", "e"]]


@pytest.mark.parametrize("tensor, source", [("output", "input"), ("L0.ssm.u", "input"), ("L1.ssm.u", "L1.block.in"),
                                            ("L12.block.out", "L12.block.in"), ("residual", "input")])
def test_input_tensor_for(tensor, source):
    assert input_tensor_for(tensor) == source


def test_equality_is_decided_over_every_chunk(monkeypatch):
    """_equal compares the flattened arrays chunk by chunk: a difference in the last chunk only is found,
    NaN at the same places (in any chunk) counts as equal, at different places not; empty arrays are equal."""
    from harness.metrics import compare

    monkeypatch.setattr(compare, "_EQUAL_CHUNK", 7)
    a = np.arange(30, dtype=np.float32).reshape(3, 10)
    b = a.copy()
    assert compare._equal(a, b)
    b[2, 9] = -1.0
    assert not compare._equal(a, b)
    a[0, 1] = a[2, 5] = np.nan
    b = a.copy()
    assert compare._equal(a, b)
    b[2, 5] = 0.0
    assert not compare._equal(a, b) and not compare._equal(b, a)
    assert compare._equal(np.zeros((0, 4), np.float32), np.zeros((0, 4), np.float32))
    assert not compare._equal(np.zeros((2, 3)), np.zeros((3, 2)))


def test_known_rows_are_keyed_by_each_modes_own_digest(monkeypatch):
    """compare_modes with known/digest: digest(mode, tensor) is asked for the mode being compared (a
    mutant asked for mode None); b's array equals a's, so its row is a's without computing it again,
    and c's differs, so it is computed."""
    import hashlib

    import harness.metrics.compare as compare

    rng = np.random.default_rng(5)
    ref = rng.standard_normal(16).astype(np.float32)
    same = rng.standard_normal(16).astype(np.float32)
    arrays = {"r": {"t": ref}, "a": {"t": same}, "b": {"t": same.copy()}, "c": {"t": same * 2}}
    asked, computed = [], []
    real = compare.error_metrics
    monkeypatch.setattr(compare, "error_metrics", lambda x, y: computed.append(y) or real(x, y))

    def digest(mode, tensor):
        asked.append(mode)
        return hashlib.sha256(arrays[mode][tensor].tobytes()).digest()

    known: dict = {}
    out = compare_modes({m: ["t"] for m in arrays}, lambda m, t: arrays[m][t], "r", known=known, digest=digest)
    assert asked == ["a", "b", "c"] and len(computed) == 2 and len(known) == 2
    assert out["modes"]["b"]["t"] == out["modes"]["a"]["t"] != out["modes"]["c"]["t"]


def _brute_force_groups(tensors, get):
    """The former quadratic rule, written out: each mode against the first mode of every group so far."""
    groups = []
    for mode in tensors:
        for group in groups:
            shared = [t for t in tensors[mode] if t in tensors[group[0]]]
            if shared and all(np.array_equal(get(group[0], t), get(mode, t), equal_nan=True) for t in shared):
                group.append(mode)
                break
        else:
            groups.append([mode])
    return [g for g in groups if len(g) > 1]


def test_identical_groups_of_many_modes_compare_each_mode_about_once(monkeypatch):
    """Issue 21 15d: 2000 modes took over 10 minutes (every mode against every group). Now each array is hashed
    once and a mode is compared only with groups whose hashes match: 300 modes with 3 tensors take at most
    one `_equal` per shared tensor of each mode that joins a group, where the former rule made 43,382."""
    import harness.metrics.compare as compare

    rng = np.random.default_rng(21)
    base = {t: rng.standard_normal((2, 5)).astype(np.float32) for t in ("input", "output", "residual")}
    arrays, tensors = {}, {}
    for i in range(300):
        mode = f"m{i}"
        arrays[mode] = {t: (a if i % 50 == 0 or t == "input" else a + np.float32(1e-3 * (i % 150 + 1)))
                        for t, a in base.items()}                       # m0 = m50 = ... ; m1 = m151 ; ...
        tensors[mode] = list(base)
    arrays["m7"]["output"] = -0.0 * arrays["m7"]["output"]              # -0.0 equals 0.0 ...
    arrays["m8"] = {**arrays["m7"], "output": 0.0 * arrays["m7"]["output"]}
    arrays["m9"] = {"input": base["input"], "extra": base["output"]}     # ... and another tensor set
    tensors["m9"] = list(arrays["m9"])
    arrays["m10"] = {"input": np.asarray(base["input"], np.float64), "output": base["output"]}  # other dtype, values equal
    tensors["m10"] = list(arrays["m10"])
    get = lambda m, t: arrays[m][t]  # noqa: E731
    calls = []
    real = compare._equal
    monkeypatch.setattr(compare, "_equal", lambda a, b: calls.append(1) or real(a, b))
    groups = identical_groups(tensors, get)
    expected = _brute_force_groups(tensors, get)
    assert groups == expected
    assert groups[0][:3] == ["m0", "m9", "m10"] and ["m7", "m8"] in groups and len(groups) == 145
    joined = sum(len(g) - 1 for g in groups)
    assert len(calls) <= 3 * joined < 3 * 300                            # the quadratic rule: 43,382 calls here
