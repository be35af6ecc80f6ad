"""Quamba2's x group diagnostics (metrics.q2groups, stats modes.M.layers.Li.q2_groups): per (SSD group, head group,
dim group) SQNR and saturation written out by a loop over the stored ranges, a forced saturation, the merge of
units, compare's table and --json, the report section, and none of it for float or Mamba-1 modes."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import ROOT
from harness.checkpoints.loading import open_checkpoint
from harness.cli import capture_main, compare_main
from harness.runner.backbone import build_backbone
from harness.emulation.capture import MAMBA2_POINTS, capture, select_points
from harness.metrics.q2groups import XGroupSums
from harness.recipes.registry import get_mode
from harness.report.build import build_report
from harness.runner.calibration import CalibrationSettings
from harness.recipes.quamba.families import calibrate_key as calibrate
from harness.runner.forwards import Forward, RefInputs, run_mode
from harness.runner.weightbank import WeightBank
from harness.store.reader import load_capture
from harness.store.format import tensor_name
from helpers import FAST_CLI, run_cli

from mamba2_fixtures import make_mamba2

SEQ = 21
SETTINGS = CalibrationSettings(num_samples=6, seqlen=SEQ, batch_size=4)
TINY2 = ROOT / "models" / "mamba2-tiny"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("q2groups")
    make_mamba2(out, ngroups=2, layers=2, seed=7, headdim=4)
    bank = WeightBank(open_checkpoint(out))
    gen = torch.Generator().manual_seed(3)
    windows = torch.randint(0, 64, (SETTINGS.num_samples, SEQ), generator=gen)
    samples = [torch.randint(0, 64, (1, SEQ), generator=gen) for _ in range(2)]
    return bank, calibrate(bank, windows, SETTINGS, 1, [], None, "quamba2").scales, samples


def _run(bank, scales, samples, layers=(0, 1)) -> dict:
    fwd = Forward(get_mode("q2-w8a8"), scales, samples, select_points(list(layers), ["block.out"], MAMBA2_POINTS), 1)
    return {i: s.stats() for i, s in run_mode(fwd, bank).x_groups.items()}


def _seen(bank, scales, samples, layer: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(values, codes) the block's quantizer saw, per sample, through the block's own probe."""
    bb = build_backbone(get_mode("q2-w8a8"), bank, scales, layer)
    seen = []
    bb.blocks[layer].x_probe = lambda v, q: seen.append((v.numpy().copy(), q.numpy().copy()))
    for ids in samples:
        bb(ids)
    return seen


def _written_out(seen, s, headdim: int) -> tuple[dict, dict, dict]:
    """Per cell (g, hg, dg): signal, noise and the saturated and total counts, one channel at a time, by walking the
    cumulative head and dim ranges; the cell's scale from the x table."""
    head_end = torch.cumsum(s.reorder.head_groups, 1).tolist()
    dim_end = torch.cumsum(s.reorder.dim_groups, 2).tolist()
    ngroups = len(head_end)
    sums: dict = {}
    for v, q in seen:
        v, q = v.reshape(-1, v.shape[-1]), q.reshape(-1, q.shape[-1])
        per_group = v.shape[-1] // ngroups
        for c in range(v.shape[-1]):
            g, head, dim = c // per_group, (c % per_group) // headdim, c % headdim
            hg = next(k for k, end in enumerate(head_end[g]) if head < end)
            dg = next(k for k, end in enumerate(dim_end[g][hg]) if dim < end)
            scale = np.float32(s.x_table[g, hg, dg])
            cell = sums.setdefault((g, hg, dg), [0.0, 0.0, 0, 0])
            for t in range(v.shape[0]):
                assert q[t, c] == int(np.clip(np.sign(v[t, c]) * np.floor(abs(v[t, c] / scale) + 0.5), -128, 127))
                deq = float(np.float32(np.float32(q[t, c]) * scale))
                cell[0] += float(v[t, c]) ** 2
                cell[1] += (float(v[t, c]) - deq) ** 2
                cell[2] += int(q[t, c] in (127, -128))
                cell[3] += 1
    return sums


def _db(signal: float, noise: float) -> float:
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


def test_group_sqnr_and_saturation_equal_a_written_out_loop(model):
    bank, scales, samples = model
    stats = _run(bank, scales, samples)
    assert sorted(stats) == [0, 1]
    for layer in (0, 1):
        s, q = scales[layer], stats[layer]
        sums = _written_out(_seen(bank, scales, samples, layer), s, bank.dims.headdim)
        assert len(sums) == 2 * 4 * 4  # every cell has channels
        for (g, hg, dg), (sig, noise, sat, n) in sums.items():
            assert q["sqnr_db"]["cells"][g][hg][dg] == pytest.approx(_db(sig, noise), rel=1e-9)
            assert q["saturation"]["cells"][g][hg][dg] == sat / n and q["count"][g][hg][dg] == n
        for g in range(2):
            for k in range(4):
                head = [sums[(g, k, d)] for d in range(4)]
                dim = [sums[(g, h, k)] for h in range(4)]
                assert q["sqnr_db"]["head_groups"][g][k] == pytest.approx(
                    _db(sum(c[0] for c in head), sum(c[1] for c in head)), rel=1e-9)
                assert q["sqnr_db"]["dim_groups"][g][k] == pytest.approx(
                    _db(sum(c[0] for c in dim), sum(c[1] for c in dim)), rel=1e-9)
        total = [sum(c[i] for c in sums.values()) for i in range(4)]
        assert q["sqnr_db"]["all"] == pytest.approx(_db(total[0], total[1]), rel=1e-9)
        assert q["saturation"]["all"] == total[2] / total[3]
        assert q["scales"]["x_table"] == s.x_table.tolist() and q["scales"]["B_scales"] == s.B_scales.tolist()
        assert q["scales"]["x_head_group_range"] == torch.cumsum(s.reorder.head_groups, 1).tolist()


def test_a_cell_forced_to_saturate_shows_it(model):
    """Cell (1, 2, 3)'s scale divided by 50: its codes saturate, its SQNR drops; the other cells do not move."""
    bank, scales, samples = model
    table = scales[0].x_table.clone()
    table[1, 2, 3] /= 50
    forced = [replace(scales[0], x_table=table), scales[1]]
    before, after = _run(bank, scales, samples, (0,))[0], _run(bank, forced, samples, (0,))[0]
    assert before["saturation"]["cells"][1][2][3] == 0 and after["saturation"]["cells"][1][2][3] > 0.2
    assert after["sqnr_db"]["cells"][1][2][3] < before["sqnr_db"]["cells"][1][2][3] - 10
    assert after["saturation"]["all"] > 0 and after["saturation"]["head_groups"][1][2] > 0
    assert after["scales"]["x_table"][1][2][3] == float(table[1, 2, 3])
    for g, hg, dg in [(0, 0, 0), (1, 2, 2), (1, 0, 3)]:
        assert after["sqnr_db"]["cells"][g][hg][dg] == before["sqnr_db"]["cells"][g][hg][dg]


def test_units_merged_in_sample_order_equal_the_serial_sums(model):
    """--workers: each sample's sums, merged in sample order, are the serial run's bit for bit."""
    bank, scales, samples = model
    serial = _run(bank, scales, samples, (0,))[0]
    fwds = [Forward(get_mode("q2-w8a8"), scales, [ids], select_points([0], ["block.out"], MAMBA2_POINTS), 0)
            for ids in samples]
    parts = [run_mode(f, bank).x_groups[0] for f in fwds]
    merged: XGroupSums = parts[0]
    merged.merge(parts[1])
    assert json.dumps(merged.stats()) == json.dumps(serial)


def test_the_isolated_replay_adds_nothing(model):
    """--isolated runs the block again on the reference's input: the diagnostics are the forward's alone."""
    bank, scales, samples = model
    points = select_points([0], ["block.out"], MAMBA2_POINTS)
    ref = run_mode(Forward(get_mode("fp32"), None, samples, points, 0, keep_inputs=(0,)), bank)
    assert not ref.x_groups  # a float mode has none
    fwd = Forward(get_mode("q2-w8a8"), scales, samples, [*points, "L0.block.isolated"], 0)
    replayed = run_mode(fwd, bank, RefInputs(False, ref.block_inputs)).x_groups[0].stats()
    assert json.dumps(replayed) == json.dumps(_run(bank, scales, samples, (0,))[0])
    assert sum(np.ravel(replayed["count"])) == len(samples) * SEQ * bank.dims.d_inner


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("q2tiny") / "c.npz"
    code = run_cli(capture_main, ["--model", TINY2, "--modes", "fp32", "q2-w8a8", "--layers", "0", "2", *FAST_CLI,
                                  "--no_cache", "--output_file", out])
    assert code == 0
    return out


def test_stats_compare_and_report_of_a_q2_run(tiny_run, tmp_path, capsys):
    cap = load_capture(tiny_run)  # the schema accepts the key
    modes = cap.manifest["modes"]
    assert "layers" not in modes["fp32"] and sorted(modes["q2-w8a8"]["layers"]) == ["L0", "L2"]
    q = modes["q2-w8a8"]["layers"]["L2"]["q2_groups"]
    assert np.shape(q["sqnr_db"]["cells"]) == (2, 4, 4) and np.shape(q["scales"]["x_dim_group_range"]) == (2, 4, 4)
    assert sum(map(sum, map(lambda g: map(sum, g), q["count"]))) == 16 * 384  # every token of every x channel
    capsys.readouterr()
    assert run_cli(compare_main, [tiny_run, "--json", tmp_path / "c.json", "--tensors", "L2.block.out"]) == 0
    text = capsys.readouterr().out
    assert "Quamba2 x groups" in text and "q2-w8a8  L2: x " in text and "q2-w8a8  L0:" not in text
    data = json.loads((tmp_path / "c.json").read_text())
    assert list(data["q2_groups"]["q2-w8a8"]) == ["L2"] and data["q2_groups"]["q2-w8a8"]["L2"]["count"] == q["count"]
    html, names = build_report(tiny_run)
    assert 'id="q2-groups"' in html and "q2_groups_q2-w8a8_L2" in names and "q2_groups_q2-w8a8_L0" in names


def test_a_mamba1_run_has_no_q2_groups(tmp_path, capsys):
    out = tmp_path / "m1.npz"
    assert run_cli(capture_main, ["--model", ROOT / "models" / "mamba-tiny", "--modes", "fp32", "1", "0", *FAST_CLI,
                                  "--no_cache", "--output_file", out]) == 0
    stats = load_capture(out).manifest
    assert all("layers" not in entry for entry in stats["modes"].values())
    capsys.readouterr()
    assert run_cli(compare_main, [out, "--json", tmp_path / "c.json"]) == 0
    assert "Quamba2 x groups" not in capsys.readouterr().out
    assert "q2_groups" not in json.loads((tmp_path / "c.json").read_text())
    html, names = build_report(out)
    assert 'id="q2-groups"' not in html and not any(n.startswith("q2_groups") for n in names)


def test_workers_give_the_serial_q2_groups(tmp_path):
    """--workers 2 (one unit per sample, merged in sample order): the same q2_groups as the serial run, bit for bit
    (both with one torch thread, as tests/runner/test_workers.py explains)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        stats = []
        for extra in ([], ["--workers", "2"]):
            out = tmp_path / f"w{len(extra)}" / "c.npz"
            out.parent.mkdir()
            assert run_cli(capture_main, ["--model", TINY2, "--modes", "fp32", "q2-w8a8", "--samples", "2", *FAST_CLI,
                                          "--no_cache", "--output_file", out, *extra]) == 0
            stats.append(load_capture(out).manifest["modes"]["q2-w8a8"]["layers"])
    finally:
        torch.set_num_threads(before)
    assert stats[0] == stats[1] and sum(np.ravel(stats[0]["L0"]["q2_groups"]["count"])) == 2 * 16 * 384


def test_a_malformed_q2_groups_entry_is_named():
    from harness.store.files import StorageError
    from harness.store.schema import check_stats

    by = {"head_groups": [[1.0]], "dim_groups": [[None]]}
    good = {"sqnr_db": {"cells": [[[1.0]]], "all": 1e999, **by}, "saturation": {"cells": [[[0.0]]], "all": 0.0, **by},
            "scales": {"x_table": [[[0.1]]], "s_x": 0.2, "B_scales": [0.1]}}
    check_stats({"modes": {"q2-w8a8": {"layers": {"L0": {"q2_groups": good}}}}}, "s.json")
    bad = {**good, "sqnr_db": {**good["sqnr_db"], "cells": [[["high"]]]}}
    with pytest.raises(StorageError, match=r"field modes\.q2-w8a8\.layers\.L0\.q2_groups\.sqnr_db\.cells"):
        check_stats({"modes": {"q2-w8a8": {"layers": {"L0": {"q2_groups": bad}}}}}, "s.json")
    flat = {**good, "saturation": {**good["saturation"], "cells": 0.5}}
    with pytest.raises(StorageError, match=r"q2_groups\.saturation\.cells: expected a list"):
        check_stats({"modes": {"q2-w8a8": {"layers": {"L0": {"q2_groups": flat}}}}}, "s.json")
    with pytest.raises(StorageError, match=r"q2_groups: expected the field 'scales'"):
        check_stats({"modes": {"q2-w8a8": {"layers": {"L0": {"q2_groups": {k: good[k] for k in
                                                                          ("sqnr_db", "saturation")}}}}}}, "s.json")


def test_the_diagnostics_move_no_number(model):
    """Every tap of a q2 run with the probe on equals the plain forward's bit for bit (the probe only reads)."""
    bank, scales, samples = model
    points = select_points([0, 1], ["all"], MAMBA2_POINTS)
    run = run_mode(Forward(get_mode("q2-w8a8"), scales, samples[:1], points, 1, basis="rotated"), bank)
    assert sorted(run.x_groups) == [0, 1]
    bb = build_backbone(get_mode("q2-w8a8"), bank, scales, 1)
    with capture(bb, points) as cap:
        bb(samples[0])
    assert bb.blocks[0].x_probe is None and len(cap) == len(run.arrays) > 20
    for point, c in cap.items():
        assert np.array_equal(run.arrays[tensor_name(point)], c.values.numpy()), point
