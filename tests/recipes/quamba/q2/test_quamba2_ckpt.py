"""Quamba2 W8A8 checkpoints: a hand-written fixture read into the q2-w8a8 block's codes and scales, runs from
it with no calibration, and every malformed checkpoint refused (exit 2 naming the key) before any work."""
from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch

from harness.checkpoints.loading import ModelDirError
from harness.recipes.quamba.formats import open_any_quamba
from harness.recipes.quamba.q2.checkpoint import open_quamba2
from harness.cli import capture_main
from helpers import run_cli
from quamba2_fixture import D_INNER, D_MODEL, NHEADS, handmade_q2_config, handmade_q2_state_dict, write_handmade_q2

M0 = "backbone.layers.0.mixer."
N_IN = 2 * D_INNER + 2 * 2 * 8 + NHEADS


@pytest.fixture(scope="module")
def handmade(tmp_path_factory):
    return write_handmade_q2(tmp_path_factory.mktemp("q2hand") / "quamba2-tiny-w8a8")


def test_reads_the_stored_codes_and_scales(handmade):
    sd = handmade_q2_state_dict()
    q = open_any_quamba(handmade)
    assert q.format == "quamba2-w8a8" and q.dims.architecture == "mamba2" and q.dims.nheads == NHEADS
    p, s = q.q2_params(0), q.layer_scales(0)
    assert torch.equal(p.in_proj, sd[M0 + "in_proj.weight"].t()[:N_IN])
    assert torch.equal(p.in_proj_b, sd[M0 + "in_proj.b"][0, :N_IN])
    assert torch.equal(p.conv[0], sd[M0 + "conv1d.weight"]) and torch.equal(p.conv[2], sd[M0 + "conv1d.bias"])
    assert p.conv[1] == tuple(sd[M0 + f"conv1d.w{c}_scale"] for c in "xBC")
    assert p.conv[3] == tuple(sd[M0 + f"conv1d.b{c}_scale"] for c in "xBC")
    assert torch.equal(p.out_proj.codes, sd[M0 + "out_proj.weight"].t()[:D_MODEL])
    assert p.out_proj.scale == float(sd[M0 + "out_proj.b"])
    assert torch.equal(p.A_log.codes, sd[M0 + "qchunk_scan.A_log"]) and p.A_log.scale == float(sd[M0 + "qchunk_scan.A_log_scale"])
    assert torch.equal(p.D.codes, sd[M0 + "qchunk_scan.D"]) and p.D.scale == float(sd[M0 + "qchunk_scan.D_scale"])
    assert torch.equal(p.fp16.dt_bias, sd[M0 + "qchunk_scan.dt_bias"].float())
    assert torch.equal(p.fp16.gnorm_weight, sd[M0 + "norm.weight"].float())
    assert (s.s_in, s.s_z, s.s_H) == (sd["backbone.layers.0.norm.output_scale"], sd[M0 + "norm.z_scale"],
                                      sd[M0 + "had.x_H_scale"])
    assert (s.s_x, s.s_B, s.s_C) == tuple(sd[M0 + f"conv1d.{c}_scale"] for c in "xBC")
    assert s.s_dt == float(sd[M0 + "qchunk_scan.dt_scale"])
    assert torch.equal(s.x_table, sd[M0 + "conv1d.x_out_scales"]) and torch.equal(s.B_scales, sd[M0 + "conv1d.B_out_scales"])
    assert torch.equal(s.ssm_state_scale, sd[M0 + "qchunk_scan.ssm_state_scale"])  # the decode step's state scale
    # group sizes from the stored cumulative ranges; without a float model the order is the checkpoint's own
    dim_range = sd[M0 + "conv1d.x_dim_group_range"]
    assert torch.equal(torch.cumsum(s.reorder.dim_groups, -1).to(torch.int32), dim_range)
    assert torch.equal(s.reorder.channel_index, torch.arange(D_INNER))
    # every x channel's output scale is its (SSD group, head group, dim group) entry of the table
    g, head, dim = 1, 5 % 4, 6
    dg = int((dim_range[g, head] > dim).to(torch.int64).argmax())
    assert float(p.x_scales[g * D_INNER // 2 + head * 8 + dim]) == float(s.x_table[g, head, dg])


def test_q2_w8a8_runs_from_the_checkpoint_without_calibration(handmade, tmp_path):
    out = tmp_path / "q.npz"
    rc = run_cli(capture_main, ["--model", handmade, "--modes", "q2-w8a8", "--output_file", out, "--seq_len", 12,
                                "--layers", 0, 1, "--taps", "all", "--quiet", "--calib_file", tmp_path / "absent.txt"])
    assert rc == 0
    stats = json.loads(out.with_name("q_stats.json").read_text())
    calib = stats["provenance"]["calibration_by_prep"]["quamba2"]
    assert calib["source"] == "checkpoint" and calib["prep"] == "quamba2"
    assert calib["scales"][1]["s_H"] == handmade_q2_state_dict()["backbone.layers.1.mixer.had.x_H_scale"]
    assert stats["modes"]["q2-w8a8"]["status"] == "ok"


def test_q2_w8a8_decodes_from_the_checkpoint_at_its_state_scales(handmade, tmp_path):
    out = tmp_path / "d.npz"
    rc = run_cli(capture_main, ["--model", handmade, "--modes", "q2-w8a8", "--output_file", out, "--seq_len", 8,
                                "--decode", 3, "--layers", 0, "--quiet", "--calib_file", tmp_path / "absent.txt"])
    assert rc == 0
    stats = json.loads(out.with_name("d_stats.json").read_text())
    assert stats["modes"]["q2-w8a8"]["status"] == "ok"
    with np.load(out, allow_pickle=False) as z:
        state = z["mode_q2-w8a8__decode.L0.state.ssm"]
    assert state.shape[:2] == (1, 3) and np.isfinite(state).all()
    # every stored state value is an int8 code times its (head, channel, n) entry of the checkpoint's table (the
    # reader keeps the checkpoint's channel order without a float model)
    from harness.kernels.ssd_step import q2_state_scales

    sd = handmade_q2_state_dict()
    table = sd[M0 + "qchunk_scan.ssm_state_scale"]
    scales = q2_state_scales(table, sd[M0 + "conv1d.x_head_group_range"], sd[M0 + "conv1d.x_dim_group_range"],
                             NHEADS, D_INNER // NHEADS).reshape(D_INNER, -1).numpy()
    codes = state[0] / scales
    assert np.abs(codes - np.rint(codes)).max() < 1e-3 and np.abs(codes).max() <= 128 and np.abs(codes).max() >= 1


def test_pretrained_dir_and_model_name_as_for_quamba1(handmade, tmp_path):
    out = tmp_path / "p.npz"
    rc = run_cli(capture_main, ["--pretrained_dir", handmade.parent, "--model", handmade.name, "--modes", "q2-w8a8",
                                "--output_file", out, "--seq_len", 8, "--quiet"])
    assert rc == 0
    stats = json.loads(out.with_name("p_stats.json").read_text())
    assert stats["provenance"]["model"]["quamba"]["ssm_layer"] == "W8A8QMamba2"


def test_fp32_needs_the_float_model(handmade, tmp_path, capsys):
    rc = run_cli(capture_main, ["--model", handmade, "--modes", "fp32", "--output_file", tmp_path / "f.npz", "--quiet"])
    assert rc == 2
    assert "--mamba_model_path" in capsys.readouterr().err
    assert not (tmp_path / "f.npz").exists()


def _bad(sd_edit=None, cfg_edit=None):
    sd, cfg = handmade_q2_state_dict(), handmade_q2_config()
    if sd_edit:
        sd_edit(sd)
    if cfg_edit:
        cfg_edit(cfg)
    return sd, cfg


def _set(key, value):
    return lambda sd: sd.__setitem__(key, value)


def _scale_at(key, index, value):
    def edit(sd):
        t = sd[key].clone()
        t.reshape(-1)[index] = value
        sd[key] = t
    return edit


BAD = {
    "missing key": (_bad(lambda sd: sd.pop(M0 + "conv1d.x_out_scales")), "conv1d.x_out_scales' is missing"),
    "missing float scale": (_bad(lambda sd: sd.pop(M0 + "conv1d.wB_scale")), "conv1d.wB_scale' is missing"),
    "wrong dtype": (_bad(_set(M0 + "qchunk_scan.A_log", torch.zeros(NHEADS, dtype=torch.int32))),
                    "qchunk_scan.A_log' is a int32 tensor"),
    "wrong shape": (_bad(_set(M0 + "in_proj.b", torch.ones(1, N_IN))), "in_proj.b' is a float32 tensor of shape [1, 168]"),
    "float stored as tensor": (_bad(_set(M0 + "conv1d.x_scale", torch.tensor(0.1))), "conv1d.x_scale' is a float32"),
    "output_scale not None": (_bad(_set(M0 + "norm.output_scale", 0.5)), "norm.output_scale' is a float, expected None"),
    "NaN float scale": (_bad(_set(M0 + "norm.z_scale", math.nan)), "norm.z_scale' is nan"),
    "zero 0-dim scale": (_bad(_set(M0 + "qchunk_scan.dt_scale", torch.tensor(0.0))), "qchunk_scan.dt_scale' is 0.0"),
    "negative table scale": (_bad(_scale_at(M0 + "conv1d.x_out_scales", 5, -0.1)), "conv1d.x_out_scales' holds 1 scales"),
    "infinite state scale": (_bad(_scale_at(M0 + "qchunk_scan.ssm_state_scale", 3, math.inf)),
                             "qchunk_scan.ssm_state_scale' holds 1"),
    "zero column factor": (_bad(_scale_at(M0 + "in_proj.b", 7, 0.0)), "in_proj.b' holds 1 scales"),
    "NaN dt_bias": (_bad(_scale_at(M0 + "qchunk_scan.dt_bias", 0, math.nan)), "qchunk_scan.dt_bias' holds 1 NaN"),
    "range not rising": (_bad(_set(M0 + "conv1d.x_dim_group_range", torch.tensor([[[2, 2, 5, 8]] * 4] * 2, dtype=torch.int32))),
                         "conv1d.x_dim_group_range' is"),
    "range wrong end": (_bad(_set(M0 + "conv1d.x_head_group_range", torch.tensor([[1, 2, 3, 5]] * 2, dtype=torch.int32))),
                        "rise strictly from above 0 to 4"),
    "stored twice differ": (_bad(_scale_at(M0 + "qchunk_scan.x_scales", 0, 0.5)), "must be equal"),
    "norm and in_proj input differ": (_bad(_set("backbone.layers.0.norm.output_scale", 0.5)), "in_proj.a' and"),
    "unknown ssm_cfg.layer": (_bad(cfg_edit=lambda c: c["ssm_cfg"].update(layer="W8A8QMamba3")),
                              "ssm_cfg.layer 'W8A8QMamba3' is not supported; supported: "),
    "W4A8 layer": (_bad(cfg_edit=lambda c: c["ssm_cfg"].update(layer="W4A8QMamba2")), "W4A8 (Marlin-QQQ int4 weights)"),
    "hybrid": (_bad(cfg_edit=lambda c: c.update(is_hybrid=True)), "a hybrid W4AX checkpoint"),
    "attention layers": (_bad(cfg_edit=lambda c: c.update(attn_layer_idx=[1])), "attention layers"),
    "bad field type": (_bad(cfg_edit=lambda c: c["ssm_cfg"].update(headdim=8.0)), "'ssm_cfg.headdim' must be an integer"),
    "too few heads per group": (_bad(cfg_edit=lambda c: c["ssm_cfg"].update(ngroups=4)),
                                "nheads / ngroups = 2 and headdim = 8 must be at least 4"),
    "fewer blocks than n_layer": (_bad(cfg_edit=lambda c: c.update(n_layer=3)), "n_layer = 3"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoint_is_refused_naming_the_key(case, tmp_path):
    (sd, cfg), needle = BAD[case]
    path = write_handmade_q2(tmp_path / "bad", sd=sd, config=cfg)
    with pytest.raises(ModelDirError) as e:
        open_quamba2(path)
    assert needle in str(e.value)


@pytest.mark.parametrize("case", ["missing key", "NaN float scale", "unknown ssm_cfg.layer"])
def test_bad_checkpoint_is_exit_2_before_any_work(case, tmp_path, capsys):
    (sd, cfg), needle = BAD[case]
    path = write_handmade_q2(tmp_path / "bad", sd=copy.deepcopy(sd), config=cfg)
    out = tmp_path / "o.npz"
    assert run_cli(capture_main, ["--model", path, "--modes", "q2-w8a8", "--output_file", out, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert not out.exists() and not out.with_name("o_stats.json").exists()


def test_is_hybrid_alone_takes_a_checkpoint_to_the_hybrid_refusal(tmp_path):
    """is_hybrid: true is Quamba's hybrid W4AX model whatever ssm_cfg.layer says: open_any_quamba gives the W4
    reader's refusal, which says why such a model is not read."""
    cfg = handmade_q2_config()
    cfg["is_hybrid"] = True
    path = write_handmade_q2(tmp_path / "q", config=cfg)
    with pytest.raises(ModelDirError, match=r"hybrid W4AX checkpoint \(ssm_cfg.layer 'W8A8QMamba2'\) is not "
                                            r"supported: Quamba's hybrid model \(a W4O16Embedding.*chooses which "
                                            r"mixer each layer runs at run time"):
        open_any_quamba(path)


def test_points_of_a_quamba2_checkpoint_lists_the_mamba2_sites(handmade, capsys):
    """points --model opens the directory through the registered checkpoint formats, as capture does (it said
    "only Mamba1 blocks are supported" of a Quamba2 checkpoint)."""
    from harness.cli import main

    assert main(["points", "--model", str(handmade)]) == 0
    listed = capsys.readouterr().out
    assert main(["points", "--architecture", "mamba2"]) == 0
    assert capsys.readouterr().out == listed and "L<i>.ssd.state" in listed


def test_points_of_a_broken_quamba2_checkpoint_is_exit_2(handmade, tmp_path, capsys):
    from harness.cli import main

    bad = tmp_path / "q2"
    bad.mkdir()
    (bad / "pytorch_model.bin").symlink_to(handmade / "pytorch_model.bin")
    cfg = handmade_q2_config()
    cfg["ssm_cfg"]["headdim"] = "8"
    (bad / "config.json").write_text(json.dumps(cfg))
    assert main(["points", "--model", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "'ssm_cfg.headdim' must be an integer" in err and "Traceback" not in err
