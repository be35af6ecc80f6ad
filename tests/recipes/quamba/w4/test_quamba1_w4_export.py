"""`export --recipe w4a8|w4a16` of a Mamba-1 model writes Quamba2's W4A8QMamba / W4A16QMamba checkpoint
(recipes.quamba.w4.export_mamba1): its keys, dtypes and shapes are those of the checkpoint written by hand from Quamba's source
(tests/fixtures/quamba1_w4_fixture.py), its in_proj and out_proj are the GPTQ cache's codes packed by the test's Marlin
packing (tests/fixtures/marlin_fixture.py), and capturing from it gives every tap of the mode bit for bit as capturing from
the float model (calibration and GPTQ)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import make_hf_model, write_hf_dir
from harness.checkpoints.loading import open_checkpoint
from harness.cli import capture_main, main
from harness.kernels.int4 import rtn_int4
from harness.runner.weightbank import WeightBank
from helpers import run_cli
from marlin_fixture import pack_given
from quamba1_w4_fixture import w4_mamba1_config, w4_mamba1_state_dict

RECIPES = ("w4a8", "w4a16")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The seeded float Mamba-1 (d_model 256, d_state 16: the hand-written fixture's sizes), a capture of both W4
    modes from it, their GPTQ cache files, and the two exports."""
    root = tmp_path_factory.mktemp("m1w4rt")
    f = write_hf_dir(root / "mamba-f", make_hf_model(vocab=4096, d_model=256, n_layer=2, d_state=16, seed=3))
    common = ["--calib_data_num", 4, "--calib_seqlen", 32, "--calib_batch_size", 4, "--cache_dir", root / "cache"]
    cap = ["--seq_len", 24, "--taps", "all", "--layers", 0, 1, "--quiet", *common]
    assert run_cli(capture_main, ["--model", f, "--modes", "q2-w4a8", "q2-w4a16", "--output_file", root / "f.npz",
                                  *cap]) == 0
    stats = json.loads((root / "f_stats.json").read_text())["provenance"]["calibration_by_prep"]
    for r in RECIPES:
        assert run_cli(main, ["export", "--model", f, "--output_dir", root / f"quamba-f-{r}", "--recipe", r, "--quiet",
                              *common]) == 0
    return root, f, cap, {r: stats[f"quamba2-{r}"]["cache_files"] for r in RECIPES}


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_export_has_the_hand_written_layout(recipe, runs):
    root = runs[0]
    mine = torch.load(root / f"quamba-f-{recipe}" / "pytorch_model.bin", weights_only=True)
    theirs, _ = w4_mamba1_state_dict(recipe.upper())
    assert set(mine) == set(theirs)
    for k, v in theirs.items():
        assert type(mine[k]) is type(v), k
        if isinstance(v, torch.Tensor):
            assert (mine[k].dtype, mine[k].shape) == (v.dtype, v.shape), k
    cfg = json.loads((root / f"quamba-f-{recipe}" / "config.json").read_text())
    hand = w4_mamba1_config(recipe.upper())
    assert {k: cfg[k] for k in ("norm_cfg", "embedding_cfg", "lm_head_cfg", "tie_embeddings")} == \
        {k: hand[k] for k in ("norm_cfg", "embedding_cfg", "lm_head_cfg", "tie_embeddings")}
    assert cfg["ssm_cfg"]["layer"] == hand["ssm_cfg"]["layer"] and cfg["ssm_cfg"]["d_state"] == 16


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_exported_linears_are_the_gptq_codes_packed_as_quamba_packs_them(recipe, runs):
    root, _, _, files = runs
    sd = torch.load(root / f"quamba-f-{recipe}" / "pytorch_model.bin", weights_only=True)
    for i, file in enumerate(files[recipe]):
        m = f"backbone.layers.{i}.mixer."
        with np.load(file, allow_pickle=False) as z:
            w = {k: torch.from_numpy(z[k]) for k in z.files if k != "__entry__"}  # the cache entry's arrays
        for name in ("in_proj", "out_proj"):
            channel = w.get(f"{name}.channel_scales") if recipe == "w4a8" else None
            if channel is not None and name == "in_proj":  # in_proj:output divided in (marlin_utils.py:254-256)
                channel = channel / torch.tensor(sd[m + "conv1d.input_scale"], dtype=torch.float32)
            packed = pack_given(w[f"{name}.codes"], w[f"{name}.group_scales"], channel)
            for key, v in packed.items():
                assert torch.equal(sd[f"{m}{name}.{key}"], v), (i, name, key)
        # x_proj (not GPTQ'd): Marlin's round to nearest of the prepared fp16 weight (tests/recipes/quamba/w4/test_mamba1_w4.py checks
        # it against marlin_utils.py), its 48 out-features padded to 64 / 256 by the test's packing
        x = rtn_int4(WeightBank(open_checkpoint(runs[1])).layer(i, "fp16", True, "quamba").x_proj, recipe == "w4a8")
        channel = None if x.channel_scales is None else \
            x.channel_scales / torch.tensor(float(sd[m + "selective_scan.B_scale"]), dtype=torch.float32)
        for key, v in pack_given(x.codes, x.group_scales, channel).items():
            assert torch.equal(sd[f"{m}x_proj.{key}"], v), (i, "x_proj", key)


@pytest.mark.parametrize("recipe", RECIPES)
def test_round_trip_through_the_export_is_bit_identical(recipe, runs):
    root, f, cap, _ = runs
    mode, d = f"q2-{recipe}", root / f"quamba-f-{recipe}"
    own, paired = root / f"{recipe}-own.npz", root / f"{recipe}-paired.npz"
    assert run_cli(capture_main, ["--model", d, "--modes", mode, "--output_file", own, *cap]) == 0
    assert run_cli(capture_main, ["--model", d, "--mamba_model_path", f, "--modes", mode, "fp32",
                                  "--output_file", paired, *cap]) == 0
    ref = np.load(root / "f.npz")
    taps = [k for k in ref.files if k.startswith(f"mode_{mode}__")]
    assert len(taps) >= 20
    for out in (own, paired):
        got = np.load(out)
        for k in taps:
            assert np.array_equal(ref[k], got[k]), (out.name, k)
    stats = json.loads(own.with_name(own.stem + "_stats.json").read_text())
    calib = stats["provenance"]["calibration_by_prep"][f"quamba2-{recipe}"]
    assert calib["source"] == "checkpoint" and "gptq" not in calib
    # the pair check compares the file's x_proj codes and conv / dt_proj / scan tensors with the float model's
    pairing = json.loads(paired.with_name(paired.stem + "_stats.json").read_text())["provenance"]["model"]["pairing"]
    assert pairing["matched"] and pairing["identical"] == 1.0, pairing
    assert {"L1.x_proj", "L1.conv_weight", "L1.dt_proj", "L1.dt_bias", "L1.A_log", "L1.D"} <= set(pairing["per_tensor"])


@pytest.mark.parametrize("recipe", RECIPES)
def test_decode_steps_from_the_export_are_bit_identical(recipe, runs):
    """--decode: the prefill then the mode's steps (W4A8: int8 conv window and SSM state at the file's s_h)."""
    root, f, cap, _ = runs
    mode = f"q2-{recipe}"
    args = ["--modes", mode, "--decode", 3, "--seq_len", 16, *cap[2:]]
    a, b = root / f"{recipe}-dec-f.npz", root / f"{recipe}-dec-q.npz"
    assert run_cli(capture_main, ["--model", f, "--output_file", a, *args]) == 0
    assert run_cli(capture_main, ["--model", root / f"quamba-f-{recipe}", "--output_file", b, *args]) == 0
    ref, got = np.load(a), np.load(b)
    taps = [k for k in ref.files if k.startswith(f"mode_{mode}__decode.")]
    assert len(taps) >= 20
    for k in [k for k in ref.files if k.startswith(f"mode_{mode}__")]:
        assert np.array_equal(ref[k], got[k]), k


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_w4_checkpoint_of_another_model_is_reported_unpaired(recipe, runs, tmp_path, capsys):
    from quamba1_w4_fixture import write_w4_mamba1

    root, f, _, _ = runs
    path, _, _ = write_w4_mamba1(tmp_path / f"quamba-other-{recipe}", recipe.upper())
    out = tmp_path / "o.npz"
    assert run_cli(capture_main, ["--model", path, "--mamba_model_path", f, "--modes", f"q2-{recipe}",
                                  "--output_file", out, "--seq_len", 8, "--quiet"]) == 0
    assert "the two probably do not belong together" in capsys.readouterr().err
    pairing = json.loads((tmp_path / "o_stats.json").read_text())["provenance"]["model"]["pairing"]
    assert not pairing["matched"] and pairing["per_tensor"]["L0.x_proj"] < 0.5


def test_a_mamba1_too_narrow_for_marlin_is_refused(tmp_path, capsys):
    f = write_hf_dir(tmp_path / "m", make_hf_model(vocab=4096, d_model=128, n_layer=1, seed=1))
    rc = run_cli(main, ["export", "--model", f, "--output_dir", tmp_path / "o", "--recipe", "w4a8", "--quiet"])
    assert rc == 2
    assert "needs d_model (in_proj's in-features) a multiple of 128 above 128 (it is 128)" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
