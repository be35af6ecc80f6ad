"""q2-w4a8 and q2-w4a16 run from a Quamba2 W4A8 / W4A16 checkpoint: no calibration, no GPTQ, the blocks' linears
are the hand-packed int4 weights (tests/fixtures/marlin_fixture.py), the rest the stored tensors; what needs the float
model says so."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import TOKENIZER
from harness.cli import capture_main
from harness.runner.backbone import build_backbone
from harness.recipes.registry import get_mode
from harness.runner.pairing import checkpoint_calibration, open_models
from helpers import capture_w4_checkpoint, run_cli
from marlin_fixture import w4_config, w4_state_dict

RECIPES = ("W4A8", "W4A16")


def _write(path, recipe):
    sd, truth = w4_state_dict([[recipe], [recipe]], vocab=4096, size=0.01)
    path.mkdir(parents=True, exist_ok=True)
    torch.save(sd, path / "pytorch_model.bin")
    (path / "config.json").write_text(json.dumps(w4_config([[recipe], [recipe]], vocab=4096)))
    shutil.copy(TOKENIZER, path / "tokenizer.json")
    return path, sd, truth


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("q2w4ckpt")
    return {r: _write(root / f"quamba2-tiny-{r.lower()}", r) for r in RECIPES}


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_mode_runs_from_the_checkpoint_without_calibration(recipe, ckpts, tmp_path):
    path, sd, _ = ckpts[recipe]
    stats, calib = capture_w4_checkpoint(path, recipe, tmp_path)
    assert stats["provenance"]["model"]["quamba"]["ssm_layer"] == f"{recipe}QMamba2"
    if recipe == "W4A8":
        assert calib["scales"][1]["w8a8"]["s_H"] == sd["backbone.layers.1.mixer.had.x_H_scale"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_blocks_use_the_hand_packed_weights_and_stored_tensors(recipe, ckpts):
    path, sd, truth = ckpts[recipe]
    models = open_models(path, None)
    scales = checkpoint_calibration(models.quamba, 1).scales
    blocks = build_backbone(get_mode(f"q2-{recipe.lower()}"), models.bank, scales, 1).blocks
    for i, block in enumerate(blocks):
        m = f"backbone.layers.{i}.mixer."
        w_in, w_out = (block.w4_in, block.out_proj.weight) if recipe == "W4A8" else \
            (block.in_proj.weight, block.out_proj.weight)
        for w, name in ((w_in, "in_proj"), (w_out, "out_proj")):
            codes, packed = truth[(i, recipe, name)]
            assert torch.equal(w.codes, codes) and torch.equal(w.group_scales, packed["groups"])
        if recipe == "W4A8":
            # in_proj's stored s_channel already has each split's output scale divided in (marlin_utils.py:254-256)
            assert torch.equal(w_in.channel_scales, truth[(i, recipe, "in_proj")][1]["channel"])
            assert torch.equal(w_out.channel_scales, truth[(i, recipe, "out_proj")][1]["channel"])
            assert torch.equal(block.q.conv[0], sd[m + "conv1d.weight"])
            assert torch.equal(block.q.A_log.codes, sd[m + "qchunk_scan.A_log"])
            assert block.s.s_in == sd[f"backbone.layers.{i}.norm.output_scale"]
        else:
            assert w_in.channel_scales is None
            assert torch.equal(block.conv1d.weight, sd[m + "conv1d.weight"][:, 0].float())
            assert torch.equal(block.ssd.A_log, sd[m + "A_log"].float())


@pytest.mark.parametrize("recipe", RECIPES)
def test_pretrained_dir_and_model_name(recipe, ckpts, tmp_path):
    path = ckpts[recipe][0]
    out = tmp_path / "p.npz"
    rc = run_cli(capture_main, ["--pretrained_dir", path.parent, "--model", path.name, "--modes", f"q2-{recipe.lower()}",
                                "--output_file", out, "--seq_len", 8, "--quiet"])
    assert rc == 0


@pytest.mark.parametrize("mode", ["fp32", "q2-w8a8", "q2-w4a16"])
def test_other_modes_need_the_float_model(mode, ckpts, tmp_path, capsys):
    rc = run_cli(capture_main, ["--model", ckpts["W4A8"][0], "--modes", mode, "--output_file", tmp_path / "f.npz",
                                "--quiet"])
    assert rc == 2
    assert "--mamba_model_path" in capsys.readouterr().err
    assert not (tmp_path / "f.npz").exists()


@pytest.mark.parametrize("key", ["backbone.layers.1.mixer.in_proj.s_group", "backbone.layers.0.mixer.conv1d.x_scale",
                                 "lm_head.weight"])
def test_a_malformed_w4_checkpoint_is_exit_2_naming_the_key(key, tmp_path, capsys):
    path, sd, _ = _write(tmp_path / "quamba2-bad-w4a8", "W4A8")
    sd = dict(sd)
    del sd[key]
    torch.save(sd, path / "pytorch_model.bin")
    out = tmp_path / "b.npz"
    rc = run_cli(capture_main, ["--model", path, "--modes", "q2-w4a8", "--output_file", out, "--quiet"])
    assert rc == 2 and f"{key!r} is missing" in capsys.readouterr().err and not out.exists()
