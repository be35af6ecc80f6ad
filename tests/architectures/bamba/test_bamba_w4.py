"""Quamba2's W4A8 and W4A16 on the hybrids (the shipped Bamba, a seeded Nemotron-H): GPTQ chains its calibration
through the attention and MLP blocks, the Mamba-2 blocks hold int4 weights (16 levels per group), the attention and
MLP blocks are the rotated fp16 float blocks, the runs end to end and in decode, the GPTQ cache, --workers 2."""
from __future__ import annotations

import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import ROOT
from harness.architectures.bamba.build import float_block, is_ssm_block
from harness.architectures.mamba2.weights import float_layer_mamba2
from harness.architectures.mamba2.build import build_mamba2_block
from harness.checkpoints.loading import open_checkpoint
from harness.emulation.gptq import gptq_group_size, gptq_int4, to_int4_weight
from harness.modes import Q2_CALIBRATION_RECIPE
from harness.recipes.quamba.families import calibrate_key
from harness.recipes.quamba.w4.block_mamba2 import EmuQ2W4A8Block, EmuW4A16Linear
from harness.recipes.quamba.w4.gptq_mamba2 import block_hessians
from harness.recipes.registry import get_mode
from harness.runner.backbone import build_backbone
from harness.runner.calibration import CalibrationSettings
from harness.runner.weightbank import WeightBank
from helpers import run_modes

from bamba_fixtures import make_bamba, make_nemotron_h

BAMBA = ROOT / "models" / "bamba-tiny"
SETTINGS = CalibrationSettings(num_samples=4, seqlen=16, batch_size=2)
KEYS = ("quamba2-w4a8", "quamba2-w4a16")
G_IN, G_OUT = gptq_group_size(192), gptq_group_size(384)  # bamba-tiny's d_model (one group a row), d_inner (128)


@pytest.fixture(scope="module")
def bamba():
    bank = WeightBank(open_checkpoint(BAMBA))
    windows = torch.randint(0, bank.dims.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    return bank, windows


@pytest.fixture(scope="module")
def calibs(bamba):
    """Each W4 key's calibration of every block of the shipped Bamba, computed once for the module."""
    bank, windows = bamba
    return {key: calibrate_key(bank, windows, SETTINGS, bank.dims.n_layer - 1, [], None, key) for key in KEYS}


def _levels(w) -> int:
    """The most distinct values any group of an Int4Weight holds (codes times the group's scale)."""
    values = (w.codes.to(torch.float32) - 8) * w.group_scales.to(torch.float32).repeat_interleave(w.group_size, 1)
    return max(len(torch.unique(g)) for g in values.reshape(-1, w.group_size))


@pytest.mark.parametrize("key", KEYS)
def test_gptq_quantizes_the_mamba2_blocks_and_runs_through_the_others(bamba, calibs, key):
    bank, windows = bamba
    calib = calibs[key]
    kinds = bank.dims.kinds
    assert [x is None for x in calib.scales] == [k != "ssm" for k in kinds] and kinds.count("ssm") == 2
    for layer, w in enumerate(calib.scales):
        if w is None:
            assert calib.info["layers"][layer] == {"float": "fp16"}
            continue
        assert (w.scales is not None) == (key == "quamba2-w4a8")
        p = float_layer_mamba2(bank.raw(layer), True, torch.float16)
        for lin, fp in ((w.in_proj, p.in_proj), (w.out_proj, p.out_proj)):
            assert _levels(lin) <= 16 < min(len(torch.unique(g)) for g in fp.reshape(-1, lin.group_size))
            assert len(torch.unique(lin.codes)) >= 14  # the int4 grid used, not a few codes


def test_the_second_mamba2_block_s_gptq_sees_the_first_s_through_attention_and_mlp(bamba, calibs):
    """Layer by layer as apply_gptq (modelutils_mamba.py:469-470): block 0 with its GPTQ weights, the attention and
    MLP blocks in rotated fp16, then the Hessians of the next Mamba-2 block."""
    bank, windows = bamba
    depth = bank.dims.n_layer - 1
    calib = calibs["quamba2-w4a16"]
    dims, ssm = bank.dims.ssm_dims(), [i for i in range(depth + 1) if is_ssm_block(bank.dims, i)]
    assert ssm[0] == 0 and ssm[1] > 1
    res = [bank.embed(b, True, torch.float16, "exact", "fp16") for b in windows.split(SETTINGS.batch_size)]
    p0 = float_layer_mamba2(bank.raw(0), True, torch.float16)
    h_in, h_out = block_hessians(build_mamba2_block(Q2_CALIBRATION_RECIPE, p0, dims, 0), res, dims)
    q_in, q_out = gptq_int4(p0.in_proj, h_in.H, G_IN)[0], gptq_int4(p0.out_proj, h_out.H, G_OUT)[0]
    block0 = build_mamba2_block(Q2_CALIBRATION_RECIPE, replace(p0, in_proj=q_in, out_proj=q_out), dims, 0)
    chained = [block0(r)[1] for r in res]
    floats = [build_mamba2_block(Q2_CALIBRATION_RECIPE, p0, dims, 0)(r)[1] for r in res]
    for i in range(1, ssm[1]):
        other = float_block(Q2_CALIBRATION_RECIPE, bank.raw(i), bank.dims, i)
        chained, floats = [other(r)[1] for r in chained], [other(r)[1] for r in floats]
    p1 = float_layer_mamba2(bank.raw(ssm[1]), True, torch.float16)
    block1 = build_mamba2_block(Q2_CALIBRATION_RECIPE, p1, dims, ssm[1])
    want = to_int4_weight(*gptq_int4(p1.in_proj, block_hessians(block1, chained, dims)[0].H, G_IN), False)
    assert torch.equal(calib.scales[ssm[1]].in_proj.codes, want.codes)
    assert torch.equal(calib.scales[ssm[1]].in_proj.group_scales, want.group_scales)
    unchained = to_int4_weight(*gptq_int4(p1.in_proj, block_hessians(block1, floats, dims)[0].H, G_IN), False)
    assert not torch.equal(unchained.codes, want.codes)  # the order matters: block 0's GPTQ outputs feed it


@pytest.mark.parametrize("mode,key", [("q2-w4a8", "quamba2-w4a8"), ("q2-w4a16", "quamba2-w4a16")])
def test_the_mamba2_blocks_are_w4_and_attention_and_mlp_equal_the_fp16_float_block(bamba, calibs, mode, key):
    bank, _ = bamba
    depth = bank.dims.n_layer - 1
    calib = calibs[key]
    backbone = build_backbone(get_mode(mode), bank, calib.scales, depth)
    x = torch.randn(1, 9, bank.dims.d_model, generator=torch.Generator().manual_seed(4))
    for i, block in enumerate(backbone.blocks):
        if is_ssm_block(bank.dims, i):
            if mode == "q2-w4a8":
                assert isinstance(block, EmuQ2W4A8Block)
            else:
                assert isinstance(block.in_proj, EmuW4A16Linear) and isinstance(block.out_proj, EmuW4A16Linear)
            fp16 = build_mamba2_block(Q2_CALIBRATION_RECIPE, float_layer_mamba2(bank.raw(i), True, torch.float16),
                                      bank.dims.ssm_dims(), i)
            assert not torch.equal(block(x)[1], fp16(x)[1])  # quantized: not the fp16 block
            assert (block(x)[1] - fp16(x)[1]).norm() / fp16(x)[1].norm() < 0.2
        else:
            want = float_block(Q2_CALIBRATION_RECIPE, bank.raw(i), bank.dims, i)
            assert type(block) is type(want) and torch.equal(block(x)[1], want(x)[1]), i


def test_w4_modes_run_end_to_end_and_decode_on_the_shipped_bamba(tmp_path):
    result = run_modes(BAMBA, tmp_path, ["fp32", "q2-w8a8", "q2-w4a8", "q2-w4a16"], layers=["all"], taps=["all"],
                       seq_len=24, end_to_end=True, decode=2)
    assert not result.failed
    kl = {m: r["kl"] for m, r in result.stats["end_to_end"].items()}
    assert kl["fp32"] == 0 < kl["q2-w8a8"] < min(kl["q2-w4a8"], kl["q2-w4a16"])
    assert max(kl["q2-w4a8"], kl["q2-w4a16"]) < 0.02 and all(np.isfinite(v) for v in kl.values())
    w4a8 = result.stats["modes"]["q2-w4a8"]["tensors"]
    assert w4a8["L0.norm.out"]["quantized"] and not w4a8["L2.norm.out"]["quantized"]  # attention: fp16
    for mode in ("q2-w4a8", "q2-w4a16"):
        values = result.by_mode[mode]["L2.attn.q"]
        assert np.array_equal(values.astype(np.float16).astype(np.float32), values), mode
        cons = result.stats["modes"][mode]["decode"]["consistency"]
        assert cons["decode.logits"]["rel_l2"] < 0.02, (mode, cons["decode.logits"])
        assert "decode.L0.state.ssm" in result.by_mode[mode] and "decode.L2.state.ssm" not in result.by_mode[mode]
    calib = result.stats["provenance"]["calibration_by_prep"]
    assert calib["quamba2-w4a16"]["layers"][1] == {"float": "fp16"} and "w8a8" in calib["quamba2-w4a8"]


def test_nemotron_h_w4_modes_and_the_gptq_cache(tmp_path):
    d = tmp_path / "model"
    make_nemotron_h(d, vocab=4096, seed=6)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(ROOT / "models" / "mamba-tiny" / name, d / name)
    (tmp_path / "a").mkdir()
    one = run_modes(d, tmp_path / "a", ["fp32", "q2-w4a8", "q2-w4a16"], layers=["all"], taps=["all"], seq_len=16,
                    end_to_end=True, decode=2)
    assert not one.failed
    kl = {m: r["kl"] for m, r in one.stats["end_to_end"].items()}
    assert kl["fp32"] == 0 < kl["q2-w4a8"] < 0.2 and 0 < kl["q2-w4a16"] < 0.2
    shutil.copytree(tmp_path / "a" / "cache", tmp_path / "b" / "cache")
    two = run_modes(d, tmp_path / "b", ["q2-w4a8", "q2-w4a16"], layers=["all"], taps=["all"], seq_len=16)
    for key in KEYS:
        first = one.stats["provenance"]["calibration_by_prep"][key]
        again = two.stats["provenance"]["calibration_by_prep"][key]
        assert first["source"] == "computed" and again["source"] == "reused", key
        assert first["layers"] == again["layers"] and again["layers"][2] == {"float": "fp16"}
    for mode in ("q2-w4a8", "q2-w4a16"):
        a, b = one.by_mode[mode], two.by_mode[mode]
        assert set(b) <= set(a) and all(np.array_equal(v, a[k]) for k, v in b.items()), mode


def test_local_workers_give_the_same_w4_arrays(tmp_path):
    """--workers 2 on a hybrid under both W4 modes: every array equals the single-process run's, bit for bit."""
    d = tmp_path / "model"
    make_bamba(d, layers=3, attn=(1,), vocab=4096, seed=3)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(ROOT / "models" / "mamba-tiny" / name, d / name)
    runs = []
    for workers in (1, 2):
        (tmp_path / str(workers)).mkdir()
        runs.append(run_modes(d, tmp_path / str(workers), ["q2-w4a8", "q2-w4a16"], layers=["all"], taps=["all"],
                              seq_len=16, end_to_end=True, workers=workers))
    one, two = runs
    assert not one.failed and not two.failed and list(one.by_mode) == list(two.by_mode) == ["q2-w4a8", "q2-w4a16"]
    for mode, arrays in one.by_mode.items():
        assert set(arrays) == set(two.by_mode[mode])
        assert all(np.array_equal(a, two.by_mode[mode][k]) for k, a in arrays.items()), mode
