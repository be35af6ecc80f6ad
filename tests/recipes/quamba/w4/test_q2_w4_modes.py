"""The q2-w4a8 and q2-w4a16 modes: GPTQ layer by layer, the blocks' int4 linears against their references,
the GPTQ cache, the recipes, and the main job on the shipped tiny Mamba-2."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import ROOT
from harness.checkpoints.loading import open_checkpoint
from harness.cli import capture_main
from harness.runner.backbone import build_backbone
from harness.architectures.mamba2.build import build_mamba2_block
from harness.emulation.gptq import Hessian, gptq_int4, to_int4_weight
from harness.kernels.w4_linear import w4a8_linear_ref, w4a16_linear_ref
from harness.architectures.mamba2.weights import float_layer_mamba2
from harness.modes import Q2_CALIBRATION_RECIPE, ModeError
from harness.recipes.quamba.families import calibrate_key
from harness.recipes.registry import get_mode, resolve_modes
from harness.runner.calibration import CalibrationSettings
from harness.runner.layercache import LayerCache
from harness.runner.weightbank import WeightBank
from harness.store.reader import load_capture
from helpers import input_hessians, run_cli

from mamba2_fixtures import make_mamba2

def calibrate(bank, windows, settings, depth, prefix_hashes, cache_dir, key="quamba", **kw):
    """The calibration of any Quamba key (recipes.quamba.families.calibrate_key), in the order of old."""
    return calibrate_key(bank, windows, settings, depth, prefix_hashes, cache_dir, key, **kw)


SEQ = 21
SETTINGS = CalibrationSettings(num_samples=6, seqlen=SEQ, batch_size=4)
TINY2 = ROOT / "models" / "mamba2-tiny"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("q2w4")
    # d_model 128: in_proj has one group of 128; d_inner 256: out_proj two
    make_mamba2(out, ngroups=2, layers=2, seed=7, d_model=128, headdim=8)
    bank = WeightBank(open_checkpoint(out))
    windows = torch.randint(0, 64, (SETTINGS.num_samples, SEQ), generator=torch.Generator().manual_seed(3))
    return bank, windows


def _embed(bank):
    return lambda ids: bank.embed(ids, True, torch.float16, "exact", "fp16")


def test_gptq_takes_each_layer_s_inputs_from_the_quantized_layers_before(model):
    bank, windows = model
    calib = calibrate(bank, windows, SETTINGS, 1, [], None, "quamba2-w4a16")
    assert calib.info["gptq"]["group_size"] == {"in_proj": 128, "out_proj": 128}
    dims, embed = bank.dims, _embed(bank)
    res = [embed(b) for b in windows.split(SETTINGS.batch_size)]
    expect, float_path = [], None
    for i in range(2):
        p = float_layer_mamba2(bank.raw(i), True, torch.float16)
        block = build_mamba2_block(Q2_CALIBRATION_RECIPE, p, dims, i)
        h_in, h_out = input_hessians(block, res, dims)  # norm.out and had.out, one sequence at a time
        q_in, s_in = gptq_int4(p.in_proj, h_in.H)
        q_out, s_out = gptq_int4(p.out_proj, h_out.H)
        expect.append(to_int4_weight(q_in, s_in, False))
        if i == 0:
            float_path = [block(r)[1] for r in res]
        res = [build_mamba2_block(Q2_CALIBRATION_RECIPE, replace(p, in_proj=q_in, out_proj=q_out), dims, i)(r)[1]
               for r in res]
    for got, want in zip(calib.scales, expect):
        assert torch.equal(got.in_proj.codes, want.codes) and torch.equal(got.in_proj.group_scales, want.group_scales)
    # layer 1 from the float layer 0's outputs would be another GPTQ: the order matters here
    p1 = float_layer_mamba2(bank.raw(1), True, torch.float16)
    h = Hessian(dims.d_model)
    block1 = build_mamba2_block(Q2_CALIBRATION_RECIPE, p1, dims, 1)
    taps = []
    hook = block1.hooks["norm_out"].register_forward_hook(lambda _m, _i, o: taps.append(o))
    for r in float_path:
        block1(r)
    hook.remove()
    for t in taps:
        for seq in t:
            h.add(seq)
    other = to_int4_weight(*gptq_int4(p1.in_proj, h.H), False)
    assert not torch.equal(other.codes, calib.scales[1].in_proj.codes)


def test_w4a8_block_runs_the_marlin_qqq_linears(model, tmp_path):
    bank, windows = model
    calib = calibrate(bank, windows, SETTINGS, 1, [], None, "quamba2-w4a8")
    w8 = calibrate(bank, windows, SETTINGS, 1, [], None, "quamba2")
    assert calib.info["w8a8"]["layers"] == w8.info["layers"]  # the W8A8 scales and groups, unchanged
    backbone = build_backbone(get_mode("q2-w4a8"), bank, calib.scales, 1)
    block, w4, d = backbone.blocks[1], calib.scales[1], bank.dims
    s = w4.scales
    residual = backbone.embed(windows[:1, :9])
    residual = backbone.blocks[0](residual)[1]
    q = block.norm(residual)
    got = block._in_proj(q)
    # the split's output scale divides the channel scale (marlin_utils.py:254-256), z | x | B | C | dt
    gs = d.ngroups * d.d_state
    out = torch.tensor([s.s_z] * d.d_inner + [s.s_x] * d.d_inner + [s.s_B] * gs + [s.s_C] * gs + [s.s_dt] * d.nheads)
    # the block takes the fused form (as a Quamba2 checkpoint stores it); the cache holds GPTQ's unfused one
    cached = calibrate(bank, windows, SETTINGS, 1, ["a", "b"], tmp_path, "quamba2-w4a8")
    with np.load(cached.info["cache_files"][1], allow_pickle=False) as f:
        unfused = torch.from_numpy(f["in_proj.channel_scales"])
    assert torch.equal(cached.scales[1].in_proj.channel_scales, w4.in_proj.channel_scales)
    assert torch.equal(w4.in_proj.channel_scales, unfused / out)
    assert torch.equal(got, w4a8_linear_ref(q, w4.in_proj, True))
    hq = block.had(torch.randn(1, 9, d.d_inner, generator=torch.Generator().manual_seed(0)))
    assert torch.equal(block.out_proj(hq), w4a8_linear_ref(hq, w4.out_proj, False))


def test_w4a16_block_runs_the_marlin_linears(model):
    bank, windows = model
    calib = calibrate(bank, windows, SETTINGS, 0, [], None, "quamba2-w4a16")
    backbone = build_backbone(get_mode("q2-w4a16"), bank, calib.scales, 0)
    block = backbone.blocks[0]
    x = block.norm(backbone.embed(windows[:1, :7]))
    assert torch.equal(block.in_proj(x), w4a16_linear_ref(x, calib.scales[0].in_proj))
    assert calib.scales[0].scales is None and calib.scales[0].in_proj.channel_scales is None


def test_gptq_cache_is_reused_and_a_bad_file_recomputed(model, tmp_path, caplog):
    bank, windows = model
    cache = tmp_path / "cache" / "gptq"  # made on first use, with its parent
    first = calibrate(bank, windows, SETTINGS, 1, ["a", "b"], cache, "quamba2-w4a16")
    again = calibrate(bank, windows, SETTINGS, 1, ["a", "b"], cache, "quamba2-w4a16")
    assert first.info["source"] == "computed" and again.info["source"] == "reused"
    for x, y in zip(first.scales, again.scales):
        assert torch.equal(x.in_proj.codes, y.in_proj.codes) and torch.equal(x.out_proj.group_scales, y.out_proj.group_scales)
    assert sorted(str(p) for p in cache.glob("gptq-*.npz")) == sorted(first.info["cache_files"])
    path = first.info["cache_files"][0]
    with np.load(path) as f:
        arrays = {k: f[k] for k in f.files}
    arrays["in_proj.codes"] = arrays["in_proj.codes"].copy()
    arrays["in_proj.codes"][0, 0] ^= 1
    with open(path, "wb") as f:
        np.savez(f, **arrays)
    third = calibrate(bank, windows, SETTINGS, 1, ["a", "b"], cache, "quamba2-w4a16")
    assert third.info["source"] == "recomputed" and "checksum mismatch" in third.info["reason"]
    assert torch.equal(third.scales[0].in_proj.codes, first.scales[0].in_proj.codes)
    # codes that do not fit the model, under a valid checksum: refused by the recipe
    del arrays["in_proj.codes"], arrays["__entry__"]
    arrays["in_proj.codes"] = np.zeros((3, 128), np.uint8)
    LayerCache(cache, "gptq").write(first.info["keys"][0], {"layer": 0}, arrays)
    fourth = calibrate(bank, windows, SETTINGS, 1, ["a", "b"], cache, "quamba2-w4a16")
    assert fourth.info["source"] == "recomputed" and "in_proj" in fourth.info["reason"]
    assert torch.equal(fourth.scales[0].in_proj.codes, first.scales[0].in_proj.codes)


def test_recipes_and_presets():
    assert get_mode("q2-w4a8").calibration_key == "quamba2-w4a8"
    assert get_mode("q2-w4a16").calibration_key == "quamba2-w4a16"
    assert get_mode("q2-w8a8").calibration_key == "quamba2" and get_mode("0").calibration_key == "quamba"
    assert get_mode("q2-w4a16").needs_calibration
    names = [r.name for r in resolve_modes(["all"], architecture="mamba2")]
    assert names == ["fp32", "1", "q2-w8a8", "q2-w4a8", "q2-w4a16"]
    assert [r.name for r in resolve_modes(["quant_only"], architecture="mamba2")] == ["q2-w8a8", "q2-w4a8", "q2-w4a16"]
    with pytest.raises(ModeError, match="does not run on a mamba1 model"):  # the W4 recipes do (test_mamba1_w4)
        resolve_modes(["q2-w8a8"], architecture="mamba1")
    with pytest.raises(ModeError, match="weights=int4 is Quamba2's GPTQ"):
        replace(get_mode("1"), name="x", weights="int4")
    with pytest.raises(ModeError, match="apply to q2-w8a8's block only"):  # the W4 blocks do not read them
        replace(get_mode("q2-w4a8"), name="x", x_groups="tensor")


def test_main_job_on_the_shipped_mamba2(tmp_path, capsys):
    out = tmp_path / "w4.npz"
    code = run_cli(capture_main, ["--model", TINY2, "--modes", "fp32", "q2-w8a8", "q2-w4a8", "q2-w4a16",
                                  "--layers", "0", "--taps", "all", "--seq_len", "64", "--calib_data_num", "8",
                                  "--calib_seqlen", "128", "--no_cache", "--output_file", out])
    assert code == 0, capsys.readouterr().err
    cap = load_capture(out)

    def rel(mode: str, point: str) -> float:
        a, ref = cap.array(mode, f"L0.{point}"), cap.array("fp32", f"L0.{point}")
        return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))

    # measured (relative L2 vs fp32): in_proj taps 0.017-0.018 (w8a8) vs 0.089-0.107 (w4), out_proj.out
    # 0.025 vs 0.13-0.14; norm.out 0.010 (int8) for w8a8 and w4a8, 0.0004 (fp16) for w4a16
    for mode in ("q2-w4a8", "q2-w4a16"):
        for point in ("in_proj.z", "in_proj.xBC", "in_proj.dt", "out_proj.out"):
            e, e8 = rel(mode, point), rel("q2-w8a8", point)
            assert np.isfinite(e) and e > 3 * e8, (mode, point, e, e8)
    assert np.array_equal(cap.array("q2-w4a8", "L0.norm.out"), cap.array("q2-w8a8", "L0.norm.out"))
    assert rel("q2-w4a16", "norm.out") < rel("q2-w8a8", "norm.out") / 10
    gptq = cap.manifest["provenance"]["calibration_by_prep"]["quamba2-w4a16"]["gptq"]
    assert gptq["group_size"] == {"in_proj": 192, "out_proj": 128}  # d_model 192 is no multiple of 128


def test_w4a8_cache_keeps_the_channel_scales(model, tmp_path):
    bank, windows = model
    first = calibrate(bank, windows, SETTINGS, 0, ["a"], tmp_path, "quamba2-w4a8")
    again = calibrate(bank, windows, SETTINGS, 0, ["a"], tmp_path, "quamba2-w4a8")
    assert first.info["source"] == "computed" and again.info["source"] == "reused"
    assert again.info["w8a8"]["source"] == "reused"  # the W8A8 scales from their own cache files
    for part in ("in_proj", "out_proj"):
        x, y = getattr(first.scales[0], part), getattr(again.scales[0], part)
        assert torch.equal(x.channel_scales, y.channel_scales) and torch.equal(x.group_scales, y.group_scales)
    assert again.scales[0].scales.s_in == first.scales[0].scales.s_in


def test_w4a8_calibration_shows_its_w8a8_and_gptq_phases(model):
    """q2-w4a8's calibration is W8A8's, then GPTQ of the reordered model: both phases reach the run's progress
    (the display, and the line printed on interruption), each with its whole number of steps, every one advanced:
    6 windows in batches of 4 are 2 batches, twice (two passes); GPTQ goes layer by layer."""
    from harness.runtime.guard import Progress

    bank, windows = model
    seen = []  # [phase, total, steps advanced]

    class Display:
        def begin(self, phase, total, unit, estimate):
            seen.append([phase.split(" (")[0], total, 0])

        def advance(self, n):
            seen[-1][2] += n

        def end(self, status):
            pass

    calibrate(bank, windows, SETTINGS, 1, ["a", "b"], None, "quamba2-w4a8", progress=Progress(Display()))
    assert seen == [["calibrating", 4, 4], ["GPTQ", 2, 2]]
