"""The collector: modes arrive block by block, the reference spilled to disk, contract 9 decided across blocks."""
from types import SimpleNamespace

import numpy as np
import pytest

from harness.collect import Collector


class Recorder:
    def __init__(self):
        self.keys = []

    def add(self, key, arr):
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
    """MODES.md contract 9 across blocks: every block output equals the float reference's."""
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
