"""q2-w4a8 and q2-w4a16 on Mamba-1 (Quamba c474646 W4A8QMamba, W4A16QMamba, quamba/qMambaLayer.py:230-757): Marlin's
round-to-nearest x_proj, the blocks' linears against their references, GPTQ layer by layer on Quamba1's
preparation, the recipes on a Mamba-1 model, the decode steps, and the main job on the shipped mamba-tiny."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import SHIPPED, make_hf_model, write_hf_dir
from harness.checkpoints.loading import open_checkpoint
from harness.cli import capture_main
from harness.runner.backbone import build_backbone
from harness.architectures.mamba1.build import build_block
from harness.emulation.gptq import gptq_int4, to_int4_weight
from harness.recipes.quamba.w4.block_mamba1 import EmuW4A8O8Linear, with_output_scale
from harness.kernels.int4 import Int4Weight
from harness.kernels.int4 import rtn_int4
from harness.kernels.w4_linear import w4a8_linear_ref, w4a8_values, w4a16_linear_ref
from harness.modes import CALIBRATION_RECIPES, ModeError
from harness.recipes.quamba.families import calibrate_key
from harness.recipes.registry import get_mode, resolve_modes
from harness.runner.calibration import CalibrationSettings
from harness.runner.weightbank import WeightBank
from harness.spec import FloatOut, QTensor
from harness.store.reader import load_capture
from harness.store.format import stats_path
from helpers import input_hessians, rel_per_step, run_cli, teacher_forced_steps

def calibrate(bank, windows, settings, depth, prefix_hashes, cache_dir, key="quamba", **kw):
    """The calibration of any Quamba key (recipes.quamba.families.calibrate_key), in the order of old."""
    return calibrate_key(bank, windows, settings, depth, prefix_hashes, cache_dir, key, **kw)


SEQ = 19
SETTINGS = CalibrationSettings(num_samples=6, seqlen=SEQ, batch_size=4)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # d_model 128: in_proj one group of 128 as in Quamba's models; d_inner 256: x_proj and out_proj two groups
    path = write_hf_dir(tmp_path_factory.mktemp("m1w4") / "m", make_hf_model(vocab=512, d_model=128, n_layer=2,
                                                                             seed=11))
    bank = WeightBank(open_checkpoint(path))
    windows = torch.randint(0, 512, (SETTINGS.num_samples, SEQ), generator=torch.Generator().manual_seed(5))
    calibs = {key: calibrate(bank, windows, SETTINGS, 1, [], None, key)
              for key in ("quamba", "quamba2-w4a8", "quamba2-w4a16")}
    return bank, windows, calibs


def _mode(name: str):
    return resolve_modes([name], architecture="mamba1")[0]


def _rtn_reference(w: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """marlin_utils.py:139-192 written out per group in numpy fp16 / fp32: codes, group scales (W4A16), channel
    scales and fused group scales (W4A8)."""
    out, k = w.shape
    codes = np.zeros((out, k), np.uint8)
    s16 = np.zeros((out, k // g), np.float16)
    for r in range(out):
        for j in range(k // g):
            grp = w[r, j * g:(j + 1) * g]
            s = np.float16(np.float32(np.abs(grp).max()) * np.float32(2 / 15))
            s16[r, j] = s
            for c, v in enumerate(grp):
                q = np.float16(np.float32(v) / np.float32(s)) if s != 0 else np.float16(np.nan)
                codes[r, j * g + c] = 0 if np.isnan(q) else min(15, max(0, int(np.rint(q)) + 8))
    w_ref = (codes.astype(np.float16) - np.float16(8)) * np.repeat(s16, g, axis=1)
    s_ch = (np.abs(w_ref).max(axis=1).astype(np.float32) / np.float32(127)).astype(np.float16).astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        fused = np.nan_to_num((s16.astype(np.float32) / s_ch[:, None]).astype(np.float16), nan=0.0)
    return codes, s16, s_ch, fused


def test_rtn_int4_by_hand():
    # s = fp16(1.0 * fl32(2/15)) = 0.13330078125; w / s in fp16: 7.5 -> 8 -> code 16 -> 15 (the max saturates),
    # -3.75 -> -4 -> 4, 1.875 -> 2 -> 10, 0 -> 8
    w = rtn_int4(torch.tensor([[1.0, -0.5, 0.25, 0.0]]), channel=False)
    assert w.codes.tolist() == [[15, 4, 10, 8]] and w.group_size == 4
    assert w.group_scales.dtype == torch.float16 and float(w.group_scales[0, 0]) == 0.13330078125


def test_rtn_int4_matches_marlin_utils_written_out():
    gen = torch.Generator().manual_seed(2)
    w = (torch.randn(3, 256, generator=gen) * 0.05).to(torch.float16)
    w[1, 128:] = 0  # an all-zero group: NaN codes -> 0
    w[2] = 0        # an all-zero row: NaN fused scales -> 0
    codes, s16, s_ch, fused = _rtn_reference(w.numpy(), 128)
    a, q = rtn_int4(w, channel=False), rtn_int4(w, channel=True)
    assert a.group_size == 128 and np.array_equal(a.codes.numpy(), codes)
    assert np.array_equal(a.group_scales.numpy(), s16) and a.channel_scales is None
    assert np.array_equal(q.codes.numpy(), codes) and np.array_equal(q.group_scales.numpy(), fused)
    assert np.array_equal(q.channel_scales.numpy(), s_ch)
    assert rtn_int4(w[:, :192], channel=False).group_size == 192  # not a multiple of 128: one group per row


def test_w4a8_o8_linear_fuses_the_output_scale_and_saturates():
    gen = torch.Generator().manual_seed(4)
    w = rtn_int4(torch.randn(8, 128, generator=gen) * 0.05, channel=True)
    x = QTensor(torch.randint(-128, 128, (2, 3, 128), generator=gen, dtype=torch.int8), 0.02)
    s_out = float(torch.tensor(0.004, dtype=torch.float32))
    lin = EmuW4A8O8Linear(with_output_scale(w, s_out), s_out)
    got = lin(x)
    fused = Int4Weight(w.codes, w.group_scales, w.channel_scales / torch.tensor(s_out), w.group_size)
    assert got.scale == s_out and torch.equal(got.codes, w4a8_linear_ref(x, fused, True))
    v = w4a8_values(x, fused)
    assert got.n_clipped == int((torch.round(v).abs() > 127).sum()) > 0  # the saturation is counted
    assert torch.equal(lin.step(x).codes, got.codes)


def test_recipes_on_mamba1():
    w4a8, w4a16 = _mode("q2-w4a8"), _mode("q2-w4a16")
    assert (str(w4a8.prep), str(w4a16.prep)) == ("quamba", "quamba")  # Quamba1's preparation on Mamba-1
    assert (w4a8.calibration_key, w4a16.calibration_key) == ("quamba2-w4a8", "quamba2-w4a16")
    assert str(_mode("0").prep) == "quamba" and str(resolve_modes(["q2-w4a8"], architecture="mamba2")[0].prep) == "quamba2"
    with pytest.raises(ModeError, match="run mode 0 there"):
        resolve_modes(["q2-w8a8"], architecture="mamba1")
    with pytest.raises(ModeError, match="q2-w4a8 or q2-w4a16 on a Mamba-1 model"):
        replace(w4a8, name="x", had_out="fp")
    # Mamba-1's presets stay Quamba1's modes: the W4 recipes are named (their GPTQ costs calibration forwards)
    assert not {"q2-w4a8", "q2-w4a16"} & {r.name for r in resolve_modes(["all"], architecture="mamba1")}


def test_w4a8_block_is_mode_0_with_marlin_qqq_linears(model):
    bank, windows, calibs = model
    w4s = calibs["quamba2-w4a8"].scales
    assert [x.scales for x in w4s] == calibs["quamba"].scales  # mode 0's scales, shared
    ours = build_backbone(_mode("q2-w4a8"), bank, w4s, 1)
    zero = build_backbone(get_mode("0"), bank, calibs["quamba"].scales, 1)
    w4, s = w4s[1], w4s[1].scales
    residual = ours.blocks[0](ours.embed(windows[:1, :9]))[1]
    q = ours.blocks[1].norm(residual)
    assert torch.equal(q.codes, zero.blocks[1].norm(residual).codes)  # QRMSNorm to int8 at s_in, as mode 0
    xz = ours.blocks[1].in_proj(q)
    assert xz.scale == s.s_xz and torch.equal(xz.codes, w4a8_linear_ref(q, w4.in_proj, True))
    fp16 = bank.layer(1, "fp16", True, "quamba")
    x_w = with_output_scale(rtn_int4(fp16.x_proj, channel=True), s.s_xp)
    assert torch.equal(w4.x_proj.codes, x_w.codes) and torch.equal(w4.x_proj.channel_scales, x_w.channel_scales)
    for part in ("conv1d", "dt_proj"):  # W8A8QMamba's int8 conv and W8A8B8O8 dt_proj
        assert torch.equal(getattr(ours.blocks[1], part).weight.codes, getattr(zero.blocks[1], part).weight.codes)
    hq = ours.blocks[1].had(torch.randn(1, 9, bank.dims.d_inner, generator=torch.Generator().manual_seed(0)))
    want = w4a8_linear_ref(hq, w4.out_proj, False)
    assert torch.equal(ours.blocks[1].out_proj(hq), want)
    assert torch.equal(ours.blocks[1].out_proj(hq), want)  # again, from the int8 weight it kept
    assert torch.equal(ours.blocks[1].in_proj(q).codes, xz.codes)


def test_w4a16_block_is_the_fp16_block_with_marlin_linears(model):
    bank, windows, calibs = model
    w4 = calibs["quamba2-w4a16"].scales[0]
    assert w4.scales is None and w4.in_proj.channel_scales is None
    block = build_backbone(_mode("q2-w4a16"), bank, calibs["quamba2-w4a16"].scales, 0).blocks[0]
    x = block.norm(bank.embed(windows[:1, :7], True, torch.float16, "quamba", "fp16"))
    assert torch.equal(block.in_proj(x), w4a16_linear_ref(x, w4.in_proj))
    assert torch.equal(w4.x_proj.codes, rtn_int4(bank.layer(0, "fp16", True, "quamba").x_proj, channel=False).codes)
    # causal_conv1d_fn: SiLU of the fp32 sum, stored fp16 (not the calibration model's fp16 sum before SiLU)
    assert block.conv1d.out == FloatOut(torch.float16) and block.conv1d.pre_silu is None


def test_gptq_takes_each_layer_s_inputs_from_the_quantized_layers_before(model):
    bank, windows, calibs = model
    dims, recipe = bank.dims, CALIBRATION_RECIPES["quamba"]
    res = [bank.embed(b, True, torch.float16, "quamba", "fp16") for b in windows.split(SETTINGS.batch_size)]
    for i in range(2):
        p = bank.layer(i, "fp16", True, "quamba")
        h_in, h_out = input_hessians(build_block(recipe, p, None, dims, i, calibration=True), res, dims)
        q_in, s_in = gptq_int4(p.in_proj, h_in.H)
        q_out, s_out = gptq_int4(p.out_proj, h_out.H)
        for key in ("quamba2-w4a16", "quamba2-w4a8"):
            got = calibs[key].scales[i]
            assert torch.equal(got.in_proj.codes, to_int4_weight(q_in, s_in, False).codes)
            assert torch.equal(got.out_proj.codes, to_int4_weight(q_out, s_out, False).codes)
        nxt = build_block(recipe, replace(p, in_proj=q_in, out_proj=q_out), None, dims, i, calibration=True)
        res = [nxt(r)[1] for r in res]
    assert calibs["quamba2-w4a8"].info["gptq"]["group_size"] == {"in_proj": 128, "out_proj": 128}
    assert calibs["quamba2-w4a8"].info["x_proj"]["group_size"] == 128


def test_gptq_cache_is_reused(model, tmp_path):
    bank, windows, calibs = model
    first = calibrate(bank, windows, SETTINGS, 1, ["a", "b"], tmp_path, "quamba2-w4a8")
    again = calibrate(bank, windows, SETTINGS, 1, ["a", "b"], tmp_path, "quamba2-w4a8")
    assert first.info["source"] == "computed" and again.info["source"] == "reused"
    assert again.info["w8a8"]["source"] == "reused"  # mode 0's calibration cache
    for x, y, z in zip(first.scales, again.scales, calibs["quamba2-w4a8"].scales):
        for part in ("in_proj", "x_proj", "out_proj"):
            a, b, c = getattr(x, part), getattr(y, part), getattr(z, part)
            assert torch.equal(a.codes, b.codes) and torch.equal(a.channel_scales, b.channel_scales)
            assert torch.equal(a.codes, c.codes) and torch.equal(a.group_scales, c.group_scales)


def test_prefill_decode_consistency_of_the_w4_steps(model):
    """Step k's residual stream against the same mode's prefill at L + k (seeded d_model-128 model, 2 layers,
    L = 12, 5 steps). Measured: q2-w4a8 0.017..0.034 (the int8 state; mode 0 0.017..0.032 here), q2-w4a16
    3.8e-4..9.2e-4 (fp16 states), fp32 4e-7..7e-7."""
    bank, windows, calibs = model
    ids = torch.randint(0, 512, (1, 17), generator=torch.Generator().manual_seed(9))
    got = {}
    for name, key in (("q2-w4a8", "quamba2-w4a8"), ("q2-w4a16", "quamba2-w4a16")):
        m = build_backbone(_mode(name), bank, calibs[key].scales, 1)
        steps, _ = teacher_forced_steps(m, ids, 12)
        got[name] = rel_per_step(steps, m(ids)[:, 12:])
    assert all(np.isfinite(v).all() for v in got.values()), got
    assert 1e-4 < max(got["q2-w4a8"]) < 0.1 and max(got["q2-w4a16"]) < 5e-3, got
    assert max(got["q2-w4a16"]) < 0.5 * max(got["q2-w4a8"]), got


def test_main_job_on_the_shipped_mamba1(tmp_path, capsys):
    out = tmp_path / "w4.npz"
    code = run_cli(capture_main, ["--model", SHIPPED, "--modes", "fp32", "0", "q2-w4a8", "q2-w4a16", "--layers", "0",
                                  "--taps", "all", "--seq_len", "32", "--calib_data_num", "8", "--calib_seqlen", "64",
                                  "--no_cache", "--decode", "2", "--output_file", out, "--quiet"])
    assert code == 0, capsys.readouterr().err
    cap = load_capture(out)

    def rel(mode: str, point: str) -> float:
        a, ref = cap.array(mode, f"L0.{point}"), cap.array("fp32", f"L0.{point}")
        return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))

    for mode in ("q2-w4a8", "q2-w4a16"):
        for point in ("in_proj.out", "out_proj.out"):
            e, e0 = rel(mode, point), rel("0", point)
            assert np.isfinite(e) and e > 2 * e0, (mode, point, e, e0)
        assert cap.array(mode, "decode.L0.block.out").shape[1] == 2
    assert np.array_equal(cap.array("q2-w4a8", "L0.norm.out"), cap.array("0", "L0.norm.out"))
    by_prep = cap.manifest["provenance"]["calibration_by_prep"]
    # d_model 192 is no multiple of 128 (one group per row); d_inner 384 is three groups
    assert by_prep["quamba2-w4a16"]["gptq"]["group_size"] == {"in_proj": 192, "out_proj": 128}
    stats = json.loads(stats_path(out).read_text())
    assert stats["modes"]["q2-w4a8"]["recipe"]["prep"] == "quamba"
