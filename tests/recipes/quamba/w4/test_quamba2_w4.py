"""Quamba2 W4A8, W4A16 and hybrid W4AX checkpoints: the blocks' Marlin linears unpacked to the codes and scales
packed in by hand (tests/fixtures/marlin_fixture.py), every other tensor handed back, and bad checkpoints refused."""
from __future__ import annotations

import json
import math

import pytest
import torch

from harness.checkpoints.loading import ModelDirError
from harness.recipes.quamba.formats import open_any_quamba
from harness.recipes.quamba.w4.checkpoint_blocks import read_w4_blocks
from harness.recipes.quamba.w4.checkpoint_mamba2 import open_quamba2_w4
from marlin_fixture import w4_config, w4_state_dict


def _write(path, sd, cfg):
    path.mkdir(parents=True, exist_ok=True)
    torch.save(sd, path / "pytorch_model.bin")
    (path / "config.json").write_text(json.dumps(cfg))
    return path


CASES = {"w4a8": ([["W4A8"], ["W4A8"]], False), "w4a16": ([["W4A16"], ["W4A16"]], False),
         "hybrid": ([["W4A8"], ["W4A8", "W4A16"]], True)}


@pytest.mark.parametrize("case", list(CASES))
def test_blocks_unpack_to_the_packed_codes_and_scales(case, tmp_path):
    recipes, hybrid = CASES[case]
    sd, truth = w4_state_dict(recipes, hybrid=hybrid)
    dims, blocks = read_w4_blocks(_write(tmp_path / "q", sd, w4_config(recipes, hybrid)))
    assert dims.d_inner == 512 and [sorted(b) for b in blocks] == [sorted(r) for r in recipes]
    for (i, recipe, name), (codes, scales) in truth.items():
        w = getattr(blocks[i][recipe], name)
        assert torch.equal(w.codes, codes), (i, recipe, name)
        assert torch.equal(w.group_scales, scales["groups"])
        if recipe == "W4A8":
            assert torch.equal(w.channel_scales, scales["channel"])
            assert blocks[i][recipe].in_scale == pytest.approx(0.05) and "conv1d.x_out_scales" in blocks[i][recipe].tensors
        else:
            assert w.channel_scales is None and blocks[i][recipe].in_scale is None
            assert blocks[i][recipe].tensors["conv1d.weight"].shape == (576, 1, 4)


def test_w4a8_blocks_hand_back_each_linears_own_input_scale(tmp_path):
    """W4A8: in_proj's and out_proj's input_scale are two numbers (the block quantizes each linear's input at its
    own); W4A16 has none."""
    recipes = [["W4A8"], ["W4A16"]]
    sd, _ = w4_state_dict(recipes, hybrid=True)
    for key in [k for k in sd if k.endswith("out_proj.input_scale")]:
        sd[key] = torch.tensor(0.125)
    _, blocks = read_w4_blocks(_write(tmp_path / "q", sd, w4_config(recipes, hybrid=True)))
    assert (blocks[0]["W4A8"].in_scale, blocks[0]["W4A8"].out_scale) == (pytest.approx(0.05), 0.125)
    assert (blocks[1]["W4A16"].in_scale, blocks[1]["W4A16"].out_scale) == (None, None)


def _bad(change, recipes=(("W4A8",), ("W4A8",)), hybrid=False):
    recipes = [list(r) for r in recipes]
    sd, _ = w4_state_dict(recipes, hybrid=hybrid)
    cfg = w4_config(recipes, hybrid)
    change(sd, cfg)
    return sd, cfg


M = "backbone.layers.1.mixer."
BAD = {
    "missing s_channel": (_bad(lambda sd, c: sd.pop(M + "in_proj.s_channel")), "in_proj.s_channel' is missing"),
    "packed weight shape": (_bad(lambda sd, c: sd.__setitem__(M + "out_proj.weight", sd[M + "out_proj.weight"][:, :64])),
                            "out_proj.weight' is a int32 tensor of shape [32, 64], expected a int32 tensor of shape "
                            "[32, 512]"),
    "negative group scale": (_bad(lambda sd, c: sd[M + "in_proj.s_group"].__setitem__((0, 0), -1.0)),
                             "in_proj.s_group' holds 1 group scales"),
    "zero channel scale": (_bad(lambda sd, c: sd[M + "out_proj.s_channel"].__setitem__((0, 0), 0.0)),
                           "out_proj.s_channel' holds 1 scales"),
    "NaN input scale": (_bad(lambda sd, c: sd.__setitem__(M + "in_proj.input_scale", torch.tensor(math.nan))),
                        "in_proj.input_scale' is nan"),
    "W4A16 float tensor as int": (_bad(lambda sd, c: sd.__setitem__(M + "D", torch.ones(8, dtype=torch.int8)),
                                       (("W4A16",), ("W4A16",))),
                                  "'backbone.layers.1.mixer.D' is a int8 tensor of shape [8], expected a floating-point tensor"),
    "hybrid class mismatch": (_bad(lambda sd, c: c["ssm_cfg"]["layer"][1].update(W4A8="W4A16QMamba2"),
                                   (("W4A8",), ("W4A8",)), True), "layer 1: ssm_cfg.layer"),
    "hybrid list length": (_bad(lambda sd, c: c["norm_cfg"]["norm"].pop(), (("W4A8",), ("W4A8",)), True),
                           "lists of n_layer = 2 tables"),
    "not a W4 layer": (_bad(lambda sd, c: c["ssm_cfg"].update(layer="W8A8QMamba2")), "as a W4 checkpoint"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_w4_checkpoint_names_the_key(case, tmp_path):
    (sd, cfg), needle = BAD[case]
    with pytest.raises(ModelDirError) as e:
        read_w4_blocks(_write(tmp_path / "q", sd, cfg))
    assert needle in str(e.value)


def test_a_run_refuses_hybrid_checkpoints_naming_the_layers(tmp_path):
    """A hybrid checkpoint is refused (recipes.quamba.w4.checkpoint_mamba2): its layers' recipes and what is supported."""
    recipes = [["W4A8"], ["W4A8", "W4A16"]]
    sd, _ = w4_state_dict(recipes, hybrid=True)
    path = _write(tmp_path / "q", sd, w4_config(recipes, hybrid=True))
    with pytest.raises(ModelDirError, match="hybrid W4AX checkpoint \\(layer 0: W4A8; layer 1: W4A8\\+W4A16\\) "
                                            "is not supported.*W4O16Embedding.*supported: Quamba2 W4 checkpoints"):
        open_any_quamba(path)


@pytest.mark.parametrize("field, value", [("embedding_cfg", "W8O16Embedding"), ("lm_head_cfg", "W4A8B16O16Linear")])
def test_other_recipes_embeddings_and_heads_are_refused_by_name(field, value, tmp_path):
    """W4O16Embedding and W4A16B16O16Linear are read (tests/recipes/quamba/w4/test_quamba_w4head.py); another recipe's are not."""
    sd, _ = w4_state_dict([["W4A16"], ["W4A16"]])
    cfg = w4_config([["W4A16"], ["W4A16"]])
    cfg[field] = {"layer": value}
    with pytest.raises(ModelDirError, match=f"{field}.layer '{value}' with W4A16 .*is not supported"):
        open_any_quamba(_write(tmp_path / "q", sd, cfg))


@pytest.mark.parametrize("recipe, order, int4", [
    ("W4A8", "the checkpoint's own", "Marlin-QQQ unpacked (kernels.marlin)"),
    ("W4A16", "the float model's (not reordered)", "Marlin unpacked (kernels.marlin)")])
def test_a_w4_checkpoint_says_its_layer_order_and_packing(recipe, order, int4, tmp_path):
    """info() (the run's provenance): W4A8's linears are Marlin-QQQ, W4A16's plain Marlin."""
    sd, _ = w4_state_dict([[recipe], [recipe]])
    ckpt = open_quamba2_w4(_write(tmp_path / "q", sd, w4_config([[recipe], [recipe]])))
    assert ckpt.info() == {"ssm_layer": f"{recipe}QMamba2", "embedding": "Embedding", "lm_head": "Linear",
                           "channel_order": order, "int4": int4}


def test_a_norm_class_of_the_wrong_type_names_the_config_file(tmp_path):
    sd, _ = w4_state_dict([["W4A8"], ["W4A8"]])
    cfg = w4_config([["W4A8"], ["W4A8"]])
    cfg["norm_cfg"] = {"norm": 7}
    path = _write(tmp_path / "q", sd, cfg)
    with pytest.raises(ModelDirError) as e:
        open_quamba2_w4(path)
    assert str(e.value) == f"{path}/config.json: field 'norm_cfg.norm' must be a string (a JSON string), got 7"
