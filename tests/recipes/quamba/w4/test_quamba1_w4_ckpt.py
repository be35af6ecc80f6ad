"""q2-w4a8 and q2-w4a16 run on a Mamba-1 model from a Quamba2 W4A8QMamba / W4A16QMamba checkpoint: no calibration,
no GPTQ; the blocks' linears are the hand-packed int4 weights (tests/fixtures/quamba1_w4_fixture.py), the rest the stored
tensors; the other mode and float modes need the float model; a malformed file is exit 2 naming the key."""
from __future__ import annotations


import pytest
import torch

from harness.checkpoints.loading import ModelDirError
from harness.recipes.quamba.formats import open_any_quamba
from harness.cli import capture_main
from harness.runner.backbone import build_backbone
from harness.recipes.registry import get_mode, on_architecture
from harness.runner.pairing import checkpoint_calibration, open_models
from helpers import capture_w4_checkpoint, run_cli
from quamba1_w4_fixture import w4_mamba1_config, w4_mamba1_state_dict, write_w4_mamba1

RECIPES = ("W4A8", "W4A16")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("q1w4ckpt")
    return {r: write_w4_mamba1(root / f"quamba-tiny-{r.lower()}", r) for r in RECIPES}


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_mode_runs_from_the_checkpoint_without_calibration(recipe, ckpts, tmp_path):
    path, sd, _ = ckpts[recipe]
    stats, calib = capture_w4_checkpoint(path, recipe, tmp_path)
    assert stats["provenance"]["model"]["quamba"]["ssm_layer"] == f"{recipe}QMamba"
    assert stats["provenance"]["model"]["architecture"] == "mamba1"
    if recipe == "W4A8":
        assert calib["scales"][1]["w8a8"]["s_H"] == sd["backbone.layers.1.mixer.had.x_H_scale"]
        assert calib["scales"][0]["w8a8"]["s_xp"] == float(sd["backbone.layers.0.mixer.selective_scan.B_scale"])


@pytest.mark.parametrize("recipe", RECIPES)
def test_pretrained_dir_and_model_name(recipe, ckpts, tmp_path):
    path = ckpts[recipe][0]
    out = tmp_path / "p.npz"
    rc = run_cli(capture_main, ["--pretrained_dir", path.parent, "--model", path.name,
                                "--modes", f"q2-{recipe.lower()}",
                                "--output_file", out, "--seq_len", 8, "--quiet"])
    assert rc == 0


def _blocks(ckpts, recipe: str):
    """(the state dict, the fixture's packed truth, the blocks 0 and 1 the mode builds from the checkpoint)."""
    path, sd, truth = ckpts[recipe]
    models = open_models(path, None)
    scales = checkpoint_calibration(models.quamba, 1).scales
    mode = on_architecture(get_mode(f"q2-{recipe.lower()}"), "mamba1")
    return sd, truth, build_backbone(mode, models.bank, scales, 1).blocks


def _check_linears(block, truth: dict, i: int) -> None:
    """in_proj, x_proj and out_proj hold the hand-packed codes and scales (W4A8: channel scales, in_proj's and
    x_proj's with their output scale divided in, marlin_utils.py:254-256; W4A16: none)."""
    for name, lin in (("in_proj", block.in_proj), ("x_proj", block.x_proj), ("out_proj", block.out_proj)):
        codes, packed = truth[(i, name)]
        assert torch.equal(lin.weight.codes, codes) and torch.equal(lin.weight.group_scales, packed["groups"])
        if "channel" in packed:
            assert torch.equal(lin.weight.channel_scales, packed["channel"])
        else:
            assert lin.weight.channel_scales is None


def test_w4a8_blocks_use_the_hand_packed_weights_and_stored_int8_tensors(ckpts):
    sd, truth, blocks = _blocks(ckpts, "W4A8")
    for i, block in enumerate(blocks):
        m = f"backbone.layers.{i}.mixer."
        _check_linears(block, truth, i)
        assert block.in_proj.weight.channel_scales is not None
        assert block.in_proj.scale == sd[m + "conv1d.input_scale"]
        assert block.x_proj.scale == float(sd[m + "selective_scan.B_scale"])
        assert torch.equal(block.conv1d.weight.codes, sd[m + "conv1d.weight"])
        assert block.conv1d.weight.scale == sd[m + "conv1d.weight_scale"]
        assert torch.equal(block.dt_proj.weight.codes, sd[m + "dt_proj.weight"].t()[:512])
        assert block.dt_proj.weight.scale == float(sd[m + "dt_proj.b"])
        assert torch.equal(block.ssm.A_log.codes, sd[m + "selective_scan.A_log"])
        assert torch.equal(block.ssm.dt_bias.codes, sd[m + "selective_scan.dt_bias"])
        assert block.norm.out.scale == sd[f"backbone.layers.{i}.norm.output_scale"]


def test_w4a16_blocks_use_the_hand_packed_weights_and_stored_fp16_tensors(ckpts):
    sd, truth, blocks = _blocks(ckpts, "W4A16")
    for i, block in enumerate(blocks):
        m = f"backbone.layers.{i}.mixer."
        _check_linears(block, truth, i)
        assert block.in_proj.weight.channel_scales is None
        assert torch.equal(block.conv1d.weight, sd[m + "conv1d.weight"][:, 0].float())
        assert torch.equal(block.conv1d.bias, sd[m + "conv1d.bias"].float())
        assert torch.equal(block.dt_proj.weight, sd[m + "dt_proj.weight"].float())
        assert torch.equal(block.ssm.dt_bias, sd[m + "dt_proj_bias"])
        assert torch.equal(block.ssm.A_log, sd[m + "A_log"]) and torch.equal(block.ssm.D, sd[m + "D"])


@pytest.mark.parametrize("mode", ["fp32", "0", "q2-w4a16"])
def test_other_modes_need_the_float_model(mode, ckpts, tmp_path, capsys):
    rc = run_cli(capture_main, ["--model", ckpts["W4A8"][0], "--modes", mode, "--output_file", tmp_path / "f.npz",
                                "--quiet"])
    assert rc == 2
    assert "--mamba_model_path" in capsys.readouterr().err
    assert not (tmp_path / "f.npz").exists()


def _drop(key):
    def apply(sd, cfg):
        del sd[key]
    return apply


def _set(key, value):
    def apply(sd, cfg):
        sd[key] = value(sd[key])
    return apply


@pytest.mark.parametrize("recipe, change, message", [
    ("W4A8", _drop("backbone.layers.1.mixer.x_proj.s_group"), "'backbone.layers.1.mixer.x_proj.s_group' is missing"),
    # x_proj's 48 out-features are padded to 64 (W4A8) / 256 (W4A16) columns (qLinearLayer.py:150-152, 24-26)
    ("W4A8", _set("backbone.layers.0.mixer.x_proj.s_channel", lambda t: t[:, :48]),
     "'backbone.layers.0.mixer.x_proj.s_channel' is a float32 tensor of shape [1, 48], expected a float32 tensor "
     "of shape [1, 64]"),
    ("W4A16", _set("backbone.layers.0.mixer.x_proj.scale", lambda t: t[:, :64]),
     "'backbone.layers.0.mixer.x_proj.scale' is a float16 tensor of shape [4, 64], expected a float16 tensor of "
     "shape [4, 256]"),
    ("W4A8", _drop("backbone.layers.0.mixer.selective_scan.D_scale"),
     "'backbone.layers.0.mixer.selective_scan.D_scale' is missing"),
    ("W4A8", _set("backbone.layers.0.mixer.dt_proj.weight", lambda t: t.to(torch.int32)),
     "'backbone.layers.0.mixer.dt_proj.weight' is a int32 tensor"),
    ("W4A8", _set("backbone.layers.1.mixer.x_proj.input_scale", lambda t: t * 2),
     "backbone.layers.1.mixer.x_proj.input_scale"),
    ("W4A8", _set("backbone.layers.0.mixer.in_proj.s_channel", lambda t: -t),
     "'backbone.layers.0.mixer.in_proj.s_channel'"),
    ("W4A16", _drop("backbone.layers.1.mixer.dt_proj_bias"), "'backbone.layers.1.mixer.dt_proj_bias' is missing"),
    ("W4A16", _set("backbone.layers.0.mixer.A_log", lambda t: t.fill_(float("nan"))),
     "'backbone.layers.0.mixer.A_log' holds 8192 NaN or Inf values"),
    ("W4A16", _drop("lm_head.weight"), "'lm_head.weight' is missing"),
])
def test_a_malformed_checkpoint_is_exit_2_naming_the_key(recipe, change, message, tmp_path, capsys):
    sd, _ = w4_mamba1_state_dict(recipe)
    change(sd, None)
    path, _, _ = write_w4_mamba1(tmp_path / "quamba-bad", recipe, sd=sd)
    out = tmp_path / "b.npz"
    rc = run_cli(capture_main, ["--model", path, "--modes", f"q2-{recipe.lower()}", "--output_file", out, "--quiet"])
    assert rc == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.glob("*.npz")) and not list(tmp_path.glob("*_stats.json"))


def _config(recipe, **changes):
    cfg = w4_mamba1_config(recipe)
    for key, value in changes.items():
        cfg[key] = value
    return cfg


@pytest.mark.parametrize("cfg, message", [
    (_config("W4A8", d_model=128), "d_model 128 (Marlin packs a linear of 128 or fewer in-features per channel"),
    (_config("W4A8", d_model=192), "d_model 192 (Marlin packs"),
    (_config("W4A8", norm_cfg={"norm": "RMSNorm"}), "norm_cfg.norm 'RMSNorm' with W4A8QMamba is not supported"),
    (_config("W4A16", norm_cfg={"norm": "QRMSNorm"}), "norm_cfg.norm 'QRMSNorm' with W4A16QMamba is not supported"),
    (_config("W4A8", embedding_cfg={"layer": "W8O16Embedding"}), "embedding_cfg.layer 'W8O16Embedding'"),
    (_config("W4A16", lm_head_cfg={"layer": "W4A8B16O16Linear"}), "lm_head_cfg.layer 'W4A8B16O16Linear'"),
    (_config("W4A8", d_intermediate=64), "a checkpoint with MLP (d_intermediate) or attention layers"),
], ids=["d128", "d192", "norm8", "norm16", "embedding", "lm_head", "mlp"])
def test_an_unsupported_config_is_named(cfg, message, tmp_path):
    recipe = cfg["ssm_cfg"]["layer"][:-len("QMamba")]
    path, _, _ = write_w4_mamba1(tmp_path / "q", recipe, config=cfg)
    with pytest.raises(ModelDirError) as err:
        open_any_quamba(path)
    assert message in str(err.value) and str(path) in str(err.value)
    assert "supported: Quamba2 W4 Mamba-1 checkpoints" in str(err.value)
