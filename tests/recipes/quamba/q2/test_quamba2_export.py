"""Quamba2 W8A8 export: Quamba's layout (against the hand-written fixture), the round trip bit for bit on the
shipped tiny Mamba-2, the channel order recovered from the float model, and the recipes not written."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from conftest import ROOT, TOKENIZER
from harness.recipes.quamba.q2.checkpoint import open_quamba2
from harness.recipes.quamba.q2.order import match_rows
from harness.cli import capture_main, main
from harness.runner.calibration import CalibrationSettings
from harness.runner.export import ExportConfig, export
from helpers import FAST_CALIB, run_cli
from mamba2_fixtures import make_mamba2
from quamba2_fixture import handmade_q2_config, handmade_q2_state_dict

TINY2 = ROOT / "models" / "mamba2-tiny"
SMALL_CALIB = CalibrationSettings(num_samples=4, seqlen=64, alpha=0.9995, batch_size=4, seed=42)


def _kind(v):
    if v is None or type(v) is float:
        return type(v)
    return (v.dtype, tuple(v.shape), v.stride())


def _load(path):
    return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A seeded transformers Mamba-2 with the fixture's sizes, exported."""
    base = tmp_path_factory.mktemp("q2export")
    make_mamba2(base / "float", vocab=4096, layers=2, seed=3)  # d_model 32, headdim 8, d_state 8, ngroups 2, chunk 8
    shutil.copy(TOKENIZER, base / "float" / "tokenizer.json")
    out = base / "quamba2-tiny-w8a8"
    export(ExportConfig(model=base / "float", output_dir=out, calib=FAST_CALIB, cache_dir=base / "cache"),
           emit=lambda _s: None)
    return out


def test_export_layout_is_quambas(exported):
    """The same keys, dtypes, shapes, strides and scalar kinds (float, None) as the hand-written checkpoint."""
    ours, theirs = _load(exported), handmade_q2_state_dict()
    assert set(ours) == set(theirs)
    for key in theirs:
        assert _kind(ours[key]) == _kind(theirs[key]), key
    w = ours["backbone.layers.0.mixer.in_proj.weight"]
    assert w.shape == (32, 176) and w.stride() == (1, 32) and not w[:, 168:].any()  # 168 outputs padded to 176
    b = ours["backbone.layers.0.mixer.in_proj.b"]
    assert bool((b[0, :168] > 0).all()) and not b[0, 168:].any()
    cfg, hand = json.loads((exported / "config.json").read_text()), handmade_q2_config()
    assert set(cfg) == set(hand) and hand["ssm_cfg"].items() <= cfg["ssm_cfg"].items()  # + d_conv, expand
    assert {k: cfg[k] for k in ("norm_cfg", "embedding_cfg", "lm_head_cfg", "tie_embeddings")} == \
        {k: hand[k] for k in ("norm_cfg", "embedding_cfg", "lm_head_cfg", "tie_embeddings")}
    q = open_quamba2(exported)  # and the reader accepts it
    assert q.dims.nheads == 8 and q.dims.chunk_size == 8


def test_export_stores_the_calibrated_scales_and_state_scales(exported):
    sd = _load(exported)
    m = "backbone.layers.1.mixer."
    assert sd[m + "out_proj.a"].item() == sd[m + "had.x_H_scale"]
    assert torch.equal(sd[m + "conv1d.x_out_scales"], sd[m + "qchunk_scan.x_scales"])
    state = sd[m + "qchunk_scan.ssm_state_scale"]
    assert bool((state > 1e-6).all()) and len(torch.unique(state)) > 10  # observed, not a placeholder
    assert sd[m + "out_proj.alpha"] == (sd[m + "out_proj.b"] * sd[m + "had.x_H_scale"]).item()


def test_round_trip_is_bit_identical_on_the_shipped_mamba2(tmp_path):
    out = tmp_path / "quamba2-tiny-w8a8"
    common = ["--calib_data_num", 4, "--calib_seqlen", 64, "--calib_batch_size", 4, "--cache_dir", tmp_path / "cache"]
    assert run_cli(main, ["export", "--model", TINY2, "--output_dir", out, "--quiet", *common]) == 0
    cap = ["--modes", "q2-w8a8", "--seq_len", 40, "--taps", "all", "--layers", 0, 1, "--quiet", *common]
    assert run_cli(capture_main, ["--model", TINY2, "--output_file", tmp_path / "f.npz", *cap]) == 0
    assert run_cli(capture_main, ["--model", out, "--mamba_model_path", TINY2, "--output_file", tmp_path / "q.npz",
                                  *cap]) == 0
    assert run_cli(capture_main, ["--model", out, "--output_file", tmp_path / "o.npz", *cap]) == 0
    f, q, o = (np.load(tmp_path / n) for n in ("f.npz", "q.npz", "o.npz"))
    taps = [k for k in f.files if k.startswith("mode_q2-w8a8")]
    assert len(taps) >= 30
    for k in taps:
        assert np.array_equal(f[k], q[k]), k
    # without the float model the taps come in the checkpoint's (reordered) order; the block's output does not
    assert np.array_equal(f["mode_q2-w8a8__L1.block.out"], o["mode_q2-w8a8__L1.block.out"])
    assert not np.array_equal(f["mode_q2-w8a8__L0.conv1d.x"], o["mode_q2-w8a8__L0.conv1d.x"])
    stats = json.loads((tmp_path / "q_stats.json").read_text())
    pairing = stats["provenance"]["model"]["pairing"]
    assert pairing["matched"] and pairing["per_tensor"]["L0"] == {"channels_exact": 1.0, "heads_exact": 1.0}


def test_match_rows_exact_then_nearest():
    g = torch.Generator().manual_seed(0)
    theirs = torch.randint(-127, 128, (12, 20), generator=g).to(torch.int16)
    perm = torch.randperm(12, generator=g)
    ours = theirs[perm].clone()
    ours[3, 5] += 1  # a row one code away (a GPU's rounding) still finds its partner
    index, exact = match_rows(ours, theirs)
    assert torch.equal(index, perm) and exact == 11


@pytest.mark.parametrize("recipe", ["w4a8", "w4a16"])
def test_w4_recipes_need_marlin_sized_linears(recipe, tmp_path, capsys):
    """mamba2-tiny's d_model 192 is not a multiple of 128: Marlin's per-group packing does not apply."""
    rc = run_cli(main, ["export", "--model", TINY2, "--output_dir", tmp_path / "o", "--recipe", recipe])
    assert rc == 2 and "Marlin" in capsys.readouterr().err and not (tmp_path / "o").exists()
