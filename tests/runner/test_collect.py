"""The collector: modes arrive block by block, the reference spilled to disk, contract 9 decided across blocks."""
from types import SimpleNamespace

import numpy as np
import pytest

from harness.runner.collect import Collector


class Recorder:
    def __init__(self):
        self.keys = []

    def add(self, key, arr, digest=None):  # PairWriter.add
        self.keys.append(key)


RECIPES = [SimpleNamespace(name="fp32", needs_calibration=False), SimpleNamespace(name="0", needs_calibration=True),
           SimpleNamespace(name="1", needs_calibration=False)]


def _blocks(seed, same_first=None):
    rng = np.random.default_rng(seed)
    out = [{f"L{i}.block.in": rng.standard_normal((1, 4, 8)).astype(np.float32),
            f"L{i}.block.out": rng.standard_normal((1, 4, 8)).astype(np.float32)} for i in range(2)]
    if same_first is not None:
        out[0] = {k: v.copy() for k, v in same_first[0].items()}
    return out


def _run(keep, tmp_path, modes_blocks, order=("fp32", "0", "1")):
    writer, modes = Recorder(), {m: {"status": "ok", "tensors": {}} for m in order}
    c = Collector(writer, "fp32", modes, RECIPES, keep=keep, spill_dir=tmp_path)
    for mode in order:
        for chunk in modes_blocks[mode]:
            c.add(mode, chunk)
        c.end(mode)
    return c, writer, modes


@pytest.mark.parametrize("keep", [True, False])
def test_a_quantizing_mode_equal_in_block_0_only_is_kept_whole_and_in_order(tmp_path, keep):
    """Block 0 equal to the float reference is no verdict yet: the mode is held, then released by block 1."""
    ref = _blocks(0)
    c, writer, modes = _run(keep, tmp_path, {"fp32": ref, "0": _blocks(1, same_first=ref), "1": _blocks(2)})
    assert modes["0"]["status"] == "ok"
    mode0 = [k for k in writer.keys if k.startswith("mode_0__")]
    assert mode0 == ["mode_0__L0.block.in", "mode_0__L0.block.out", "mode_0__L1.block.in", "mode_0__L1.block.out"]
    out = c.finish(["fp32", "0", "1"])
    assert out["modes"]["0"]["L0.block.out"]["identical"] is True
    assert out["modes"]["0"]["L1.block.out"]["identical"] is False
    assert set(out["modes"]["1"]) == {"L0.block.in", "L0.block.out", "L1.block.in", "L1.block.out"}


@pytest.mark.parametrize("keep", [True, False])
def test_a_quantizing_mode_equal_everywhere_is_an_error_with_nothing_written(tmp_path, keep):
    """docs/spec/modes.md contract 9 across blocks: every block output equals the float reference's."""
    ref = _blocks(0)
    same = [{k: v.copy() for k, v in chunk.items()} for chunk in ref]
    c, writer, modes = _run(keep, tmp_path, {"fp32": ref, "0": same, "1": [{k: v.copy() for k, v in ch.items()} for ch in ref]})
    assert modes["0"]["status"] == "error" and "did not take effect" in modes["0"]["error"]
    assert not [k for k in writer.keys if k.startswith("mode_0__")]
    assert modes["1"]["status"] == "ok"   # a float mode may equal the reference
    out = c.finish(["fp32", "0", "1"])
    assert "0" not in out["modes"] and out["identical_groups"] == [["fp32", "1"]]


def test_the_spilled_reference_gives_the_comparison_of_the_held_one_and_is_removed(tmp_path):
    blocks = {"fp32": _blocks(0), "0": _blocks(1), "1": _blocks(2)}
    (tmp_path / "held").mkdir(), (tmp_path / "spill").mkdir()
    held, _, _ = _run(True, tmp_path / "held", blocks)
    spilled, _, _ = _run(False, tmp_path / "spill", blocks)
    assert len(list((tmp_path / "spill").iterdir())) == 1   # the spill directory, while the run goes on
    assert np.array_equal(spilled.ref_get("L1.block.out"), blocks["fp32"][1]["L1.block.out"])
    a, b = held.finish(["fp32", "0", "1"]), spilled.finish(["fp32", "0", "1"])
    assert a == b and list(held.by_mode) == ["fp32", "0", "1"] and spilled.by_mode == {}
    assert list((tmp_path / "spill").iterdir()) == []


def test_a_mode_before_the_reference_waits_and_a_failed_mode_leaves_the_comparison(tmp_path):
    writer, modes = Recorder(), {m: {"status": "ok", "tensors": {}} for m in ("1", "fp32", "0")}
    c = Collector(writer, "fp32", modes, RECIPES, keep=False, spill_dir=tmp_path)
    early = _blocks(2)
    for chunk in early:
        c.add("1", chunk)
    c.end("1")
    assert not c.has_reference and writer.keys == []   # waits for the reference
    for chunk in _blocks(0):
        c.add("fp32", chunk)
    c.end("fp32")
    assert [k for k in writer.keys if k.startswith("mode_1__")]
    c.add("0", _blocks(1)[0])
    c.failed("0")
    out = c.finish(["1", "fp32", "0"])
    assert set(out["modes"]) == {"1"} and all("0" not in g for g in out["identical_groups"])


def test_only_block_outputs_decide_contract_9_and_layer_0s_output_is_named_output(tmp_path):
    """Which tensors count as outputs for contract 9: "output" (layer 0's block.out in the research layout)
    and L{i}.block.out, nothing else. Were "output" not counted, a mode differing there but equal at
    block 1 would be an error; were inputs counted, a mode equal at every output would pass."""
    rng = np.random.default_rng(5)
    ref = [{"input": rng.standard_normal((1, 4, 8)).astype(np.float32),
            "output": rng.standard_normal((1, 4, 8)).astype(np.float32)},
           {"L1.block.in": rng.standard_normal((1, 4, 8)).astype(np.float32),
            "L1.block.out": rng.standard_normal((1, 4, 8)).astype(np.float32)}]
    differs_at_output = [{"input": ref[0]["input"].copy(), "output": ref[0]["output"] + 1},
                         {k: v.copy() for k, v in ref[1].items()}]
    only_inputs_differ = [{"input": ref[0]["input"] + 1, "output": ref[0]["output"].copy()},
                          {"L1.block.in": ref[1]["L1.block.in"] + 1, "L1.block.out": ref[1]["L1.block.out"].copy()}]
    _, writer, modes = _run(False, tmp_path, {"fp32": ref, "0": differs_at_output, "1": _blocks(2)})
    assert modes["0"]["status"] == "ok" and "mode_0_output" in writer.keys
    _, writer, modes = _run(False, tmp_path, {"fp32": ref, "0": only_inputs_differ, "1": _blocks(2)})
    assert modes["0"]["status"] == "error" and not [k for k in writer.keys if k.startswith("mode_0")]


def test_the_spill_directory_is_hidden_named_and_its_loss_does_not_fail_the_run(tmp_path):
    """The README names the spill directory (.quamba-harness-reference-*) so users know what it is; a
    directory deleted by someone else while the run goes on must not turn the end of the run into an error."""
    import shutil

    writer, modes = Recorder(), {m: {"status": "ok", "tensors": {}} for m in ("fp32", "1")}
    c = Collector(writer, "fp32", modes, RECIPES, keep=False, spill_dir=tmp_path)
    for chunk in _blocks(0):
        c.add("fp32", chunk)
    c.end("fp32")
    (spill,) = list(tmp_path.iterdir())
    assert spill.name.startswith(".quamba-harness-reference-") and len(list(spill.iterdir())) == 4
    shutil.rmtree(spill)
    assert c.finish(["fp32"])["modes"] == {}


def test_a_spilled_file_holding_a_pickle_is_refused(tmp_path):
    """The spill files are read back memory-mapped with allow_pickle=False: an object array put there in
    their place (anything that can write the output's directory) must not be unpickled."""
    writer, modes = Recorder(), {m: {"status": "ok", "tensors": {}} for m in ("fp32",)}
    c = Collector(writer, "fp32", modes, RECIPES, keep=False, spill_dir=tmp_path)
    c.add("fp32", {"output": np.ones(3, np.float32)})
    (spill,) = list(tmp_path.iterdir())
    (npy,) = list(spill.iterdir())
    np.save(npy, np.array([{"x": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="can't be memory-mapped: Python objects"):
        c.ref_get("output")


def test_a_spilled_file_replaced_by_a_raw_pickle_is_refused(tmp_path):
    """A spill file that is neither .npy nor .npz (a bare pickle put in its place) is refused, never unpickled:
    np.load falls back to pickle.load for such a file unless allow_pickle is False (mutant collect _Spill.get 8)."""
    import pickle

    writer, modes = Recorder(), {"fp32": {"status": "ok", "tensors": {}}}
    c = Collector(writer, "fp32", modes, RECIPES, keep=False, spill_dir=tmp_path)
    c.add("fp32", {"output": np.ones(3, np.float32)})
    (spill,) = list(tmp_path.iterdir())
    (npy,) = list(spill.iterdir())
    npy.write_bytes(pickle.dumps([1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match="pickled"):
        c.ref_get("output")


def test_a_failed_mode_before_the_reference_leaves_the_modes_that_ended_waiting_alone(tmp_path):
    """failed() forgets only the failed mode's pending end: a quantizing mode that arrived and ended before the
    reference must still be decided when the reference ends (else one equal to it everywhere passed as ok)."""
    writer, modes = Recorder(), {m: {"status": "ok", "tensors": {}} for m in ("0", "1", "fp32")}
    c = Collector(writer, "fp32", modes, RECIPES, keep=False, spill_dir=tmp_path)
    ref = _blocks(0)
    for chunk in ref:
        c.add("0", {k: v.copy() for k, v in chunk.items()})
    c.end("0")
    c.add("1", _blocks(2)[0])
    c.failed("1")
    for chunk in ref:
        c.add("fp32", chunk)
    c.end("fp32")
    out = c.finish(["0", "1", "fp32"])
    assert modes["0"]["status"] == "error" and "did not take effect" in modes["0"]["error"]
    assert out["modes"] == {} and not [k for k in writer.keys if k.startswith(("mode_0_", "mode_1_"))]


def test_once_released_a_mode_is_never_held_again(tmp_path):
    """A quantizing mode that differs at block 0 and equals the reference at block 1 (a block whose output
    the quantization happens not to change) is ok with every block written: block 1 must not be held, or
    the mode would end as "the quantization did not take effect"."""
    ref = _blocks(0)
    mode0 = [_blocks(1)[0], {k: v.copy() for k, v in ref[1].items()}]
    _, writer, modes = _run(False, tmp_path, {"fp32": ref, "0": mode0, "1": _blocks(2)})
    assert modes["0"]["status"] == "ok"
    assert len([k for k in writer.keys if k.startswith("mode_0__")]) == 4


@pytest.mark.parametrize("keep", [True, False])
def test_rows_are_the_reference_against_the_mode_and_other_bases_are_skipped(tmp_path, keep):
    """Each row is error_metrics(reference, mode) (rel_l2 and SQNR are not symmetric: swapped, they would
    describe the reference's error against the mode), and a tensor stored in another basis than the
    reference's is skipped with the reason, not compared."""
    from harness.metrics.errors import error_metrics

    blocks = {"fp32": _blocks(0), "0": _blocks(1), "1": _blocks(2)}
    writer, modes = Recorder(), {m: {"status": "ok", "tensors": {}} for m in ("fp32", "0", "1")}
    for m in modes:
        modes[m]["tensors"] = {"L1.block.out": {"basis": "rotated" if m == "1" else "original"}}
    c = Collector(writer, "fp32", modes, RECIPES, keep=keep, spill_dir=tmp_path)
    for mode in ("fp32", "0", "1"):
        for chunk in blocks[mode]:
            c.add(mode, chunk)
        c.end(mode)
    out = c.finish(["fp32", "0", "1"])
    row = out["modes"]["0"]["L1.block.out"]
    want = error_metrics(blocks["fp32"][1]["L1.block.out"], blocks["0"][1]["L1.block.out"])
    assert row["rel_l2"] == want["rel_l2"] and row["sqnr_db"] == want["sqnr_db"]
    assert "L1.block.out" not in out["modes"]["1"]
    assert out["skipped"]["1"]["L1.block.out"] == "basis differs (rotated vs original)"


def test_a_failing_comparison_is_reported_and_the_arrays_are_still_written(tmp_path, monkeypatch, capsys):
    """The comparison must never cost the arrays: an exception in it is recorded once (type and message), said
    on stderr, and every mode's arrays are still written."""
    import harness.runner.collect as collect

    def boom(*_a, **_k):
        raise RuntimeError("boom")
    monkeypatch.setattr(collect, "compare_modes", boom)
    c, writer, modes = _run(False, tmp_path, {"fp32": _blocks(0), "0": _blocks(1), "1": _blocks(2)})
    assert c.finish(["fp32", "0", "1"]) == {"error": "RuntimeError: boom"}
    assert "error: the comparison failed (RuntimeError: boom); the arrays are written" in capsys.readouterr().err
    assert len(writer.keys) == 12


def test_identical_groups_come_from_byte_digests(tmp_path):
    """Groups are found from a sha256 per array: arrays that differ are never grouped (a digest of anything but
    the array grouped every mode), equal arrays always are (the array [337.0], whose digest read as float64
    holds a NaN pattern); block_io_names picks the block I/O tensors for the printed table."""
    from harness.runner.collect import block_io_names

    same = {"output": np.array([337.0], np.float32)}
    writer, modes = Recorder(), {m: {"status": "ok", "tensors": {}} for m in ("fp32", "1", "2")}
    recipes = RECIPES + [SimpleNamespace(name="2", needs_calibration=False)]
    c = Collector(writer, "fp32", modes, recipes, keep=False, spill_dir=tmp_path)
    for mode, arrays in (("fp32", same), ("1", {"output": same["output"].copy()}),
                         ("2", {"output": np.array([338.0], np.float32)})):
        c.add(mode, arrays)
        c.end(mode)
    assert c.finish(["fp32", "1", "2"])["identical_groups"] == [["fp32", "1"]]
    assert block_io_names(["input", "output", "residual", "L1.block.out", "L1.ssm.u", "logits"]) == \
        ["input", "output", "residual", "L1.block.out"]
    assert block_io_names(None) == []


def test_where_the_reference_is_kept_follows_keep_and_spill_dir(tmp_path):
    """keep (default True) keeps every array in memory and spills nothing; keep=False without a spill
    directory keeps the reference in memory; has_reference is False until the reference ended."""
    blocks = {"fp32": _blocks(0), "1": _blocks(2)}
    for kw, spilled in (({}, False), ({"keep": True, "spill_dir": tmp_path}, False), ({"keep": False}, False),
                        ({"keep": False, "spill_dir": tmp_path}, True)):
        modes = {m: {"status": "ok", "tensors": {}} for m in blocks}
        c = Collector(Recorder(), "fp32", modes, RECIPES, **kw)
        for mode in blocks:
            assert c.has_reference is (mode != "fp32")
            for chunk in blocks[mode]:
                c.add(mode, chunk)
            c.end(mode)
        assert (len(list(tmp_path.iterdir())) == 1) is spilled, kw
        assert np.array_equal(c.ref_get("L1.block.out"), blocks["fp32"][1]["L1.block.out"])
        out = c.finish(["fp32", "1"])
        assert set(out["modes"]["1"]) == {"L0.block.in", "L0.block.out", "L1.block.in", "L1.block.out"}
        assert list(c.by_mode) == (["fp32", "1"] if kw.get("keep", True) else [])
        assert list(tmp_path.iterdir()) == []


def test_contract_9_needs_a_float_reference(tmp_path):
    """Against a quantizing reference, a quantizing mode equal to it is no error (2-1 = 2-2 happens)."""
    recipes = [SimpleNamespace(name="0", needs_calibration=True), SimpleNamespace(name="2-1", needs_calibration=True)]
    ref = _blocks(0)
    modes = {m: {"status": "ok", "tensors": {}} for m in ("0", "2-1")}
    c = Collector(Recorder(), "0", modes, recipes, keep=False, spill_dir=tmp_path)
    for mode, blocks in (("0", ref), ("2-1", [{k: v.copy() for k, v in ch.items()} for ch in ref])):
        for chunk in blocks:
            c.add(mode, chunk)
        c.end(mode)
    assert modes["2-1"]["status"] == "ok" and c.finish(["0", "2-1"])["identical_groups"] == [["0", "2-1"]]


def test_a_resumed_or_outputless_quantizing_mode_is_written_and_entries_need_no_tensors_key(tmp_path):
    """A mode kept from the file by --resume is not judged again by contract 9 (its entry says "resumed");
    chunks without any block output decide nothing and are written when the mode ends; an entry without
    "tensors" is compared as one without a basis."""
    ref = _blocks(0)
    modes = {"fp32": {"status": "ok"}, "0": {"status": "ok", "resumed": True}, "1": {"status": "ok"}}
    writer = Recorder()
    c = Collector(writer, "fp32", modes, RECIPES, keep=False, spill_dir=tmp_path)
    for mode, blocks in (("fp32", ref), ("0", [{k: v.copy() for k, v in ch.items()} for ch in ref]),
                         ("1", [{"L0.block.in": ref[0]["L0.block.in"] + 1}])):
        for chunk in blocks:
            c.add(mode, chunk)
        c.end(mode)
    out = c.finish(["fp32", "0", "1"])
    assert modes["0"]["status"] == "ok" and len([k for k in writer.keys if k.startswith("mode_0__")]) == 4
    assert set(out["modes"]["0"]) == {"L0.block.in", "L0.block.out", "L1.block.in", "L1.block.out"}
    quant = [SimpleNamespace(name="fp32", needs_calibration=False), SimpleNamespace(name="0", needs_calibration=True)]
    modes = {m: {"status": "ok", "tensors": {}} for m in ("fp32", "0")}
    writer = Recorder()
    c = Collector(writer, "fp32", modes, quant, keep=False, spill_dir=tmp_path)
    c.add("fp32", {"L0.ssm.u": np.zeros(3, np.float32)})
    c.end("fp32")
    c.add("0", {"L0.ssm.u": np.ones(3, np.float32)})
    assert writer.keys == ["mode_fp32__L0.ssm.u"]   # held: no block output decided it yet
    c.end("0")
    assert modes["0"]["status"] == "ok" and writer.keys[-1] == "mode_0__L0.ssm.u"
    assert c.finish(["fp32", "0"])["modes"]["0"]["L0.ssm.u"]["max_abs"] == 1.0


def test_an_array_an_earlier_mode_had_takes_its_metrics_without_computing_them(tmp_path, monkeypatch):
    """Mode 1's L1.block.out is mode 0's bit for bit: its row is mode 0's (equal to computing it), and
    error_metrics runs once for it; a copy with one -0.0 for a 0.0 (equal values, other bits) is computed
    anew. input_differs stays each mode's own: mode 1's block input is the reference's, mode 0's is not."""
    import harness.metrics.compare as compare

    calls = []
    real = compare.error_metrics
    monkeypatch.setattr(compare, "error_metrics", lambda ref, test: calls.append(test.copy()) or real(ref, test))
    ref, zero = _blocks(0), _blocks(1)
    zero[1]["L1.block.out"][0, 0, 0] = 0.0
    one = _blocks(2)
    one[1]["L1.block.out"] = zero[1]["L1.block.out"].copy()
    one[1]["L1.block.in"] = ref[1]["L1.block.in"].copy()  # mode 1's block input is the reference's
    signed = _blocks(3)
    signed[1]["L1.block.out"] = zero[1]["L1.block.out"].copy()
    signed[1]["L1.block.out"][0, 0, 0] = -0.0
    recipes = RECIPES + [SimpleNamespace(name="s", needs_calibration=False)]
    modes = {m: {"status": "ok", "tensors": {}} for m in ("fp32", "0", "1", "s")}
    c = Collector(Recorder(), "fp32", modes, recipes, keep=True, spill_dir=tmp_path)
    for mode, blocks in (("fp32", ref), ("0", zero), ("1", one), ("s", signed)):
        for chunk in blocks:
            c.add(mode, chunk)
        c.end(mode)
    out = c.finish(["fp32", "0", "1", "s"])["modes"]
    computed = [a for a in calls if a.shape == (1, 4, 8) and np.array_equal(a, zero[1]["L1.block.out"])]
    assert len(computed) == 2  # mode 0's and the -0.0 copy's; not mode 1's
    alone = real(ref[1]["L1.block.out"], zero[1]["L1.block.out"])
    for mode in ("0", "1"):
        row = out[mode]["L1.block.out"]
        assert {k: row[k] for k in alone} == alone and row["identical"] is False
    assert out["0"]["L1.block.out"]["input_differs"] is True and out["1"]["L1.block.out"]["input_differs"] is False
    assert out["s"]["L1.block.out"]["mse"] == out["0"]["L1.block.out"]["mse"]
    out["1"]["L1.block.out"]["mse"] = -1.0  # rows are copies: another mode's stays as it was
    assert out["0"]["L1.block.out"]["mse"] == alone["mse"]
