"""Round trip of the W4 modes through a Quamba2 W4A8 / W4A16 checkpoint: q2-w4a8 (q2-w4a16) run from a seeded
float Mamba-2 (GPTQ), its Int4Weights packed with the test's Marlin packing (tests/fixtures/marlin_fixture.py, written
from Quamba's source) into a checkpoint together with the mode's scales, and run again from that checkpoint: every
quantized tap bit-identical (the W4A8 channel order recovered from the float model)."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from conftest import TOKENIZER
from harness.checkpoints.loading import open_checkpoint
from harness.cli import capture_main, main
from harness.architectures.mamba2.weights import float_layer_mamba2
from helpers import run_cli
from mamba2_fixtures import make_mamba2
from marlin_fixture import pack_given

E, GS, H = 512, 2 * 16, 16  # d_inner, ngroups * d_state, nheads of the model below


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The float model, Quamba2 W8A8 export (the W4A8 activation path and the embedding and head), a capture of
    both W4 modes from the float model and its GPTQ cache files."""
    root = tmp_path_factory.mktemp("w4rt")
    f = root / "mamba2-f"
    make_mamba2(f, ngroups=2, layers=2, chunk=8, d_model=256, headdim=32, d_state=16, vocab=4096, seed=5)
    shutil.copy(TOKENIZER, f / "tokenizer.json")
    common = ["--calib_data_num", 4, "--calib_seqlen", 32, "--calib_batch_size", 4, "--cache_dir", root / "cache"]
    assert run_cli(main, ["export", "--model", f, "--output_dir", root / "w8", "--quiet", *common]) == 0
    cap = ["--seq_len", 24, "--taps", "all", "--layers", 0, 1, "--quiet", *common]
    assert run_cli(capture_main, ["--model", f, "--modes", "q2-w4a8", "q2-w4a16", "--output_file", root / "f.npz",
                                  *cap]) == 0
    stats = json.loads((root / "f_stats.json").read_text())["provenance"]["calibration_by_prep"]
    return root, f, cap, common, {k: stats[k]["cache_files"] for k in ("quamba2-w4a8", "quamba2-w4a16")}


def _gptq(path: str) -> dict:
    with np.load(path, allow_pickle=False) as z:
        return {k: torch.from_numpy(z[k]) for k in z.files if k != "__entry__"}  # the cache entry's arrays


def _w4_checkpoint(root, f, files: list[str], recipe: str):
    sd = torch.load(root / "w8" / "pytorch_model.bin", weights_only=True)
    cfg = json.loads((root / "w8" / "config.json").read_text())
    out = {k: v for k, v in sd.items() if not k.startswith("backbone.layers.")}
    for i, file in enumerate(files):
        p, m = f"backbone.layers.{i}.", f"backbone.layers.{i}.mixer."
        w = _gptq(file)
        if recipe == "W4A8":  # W8A8QMamba2's activation path (qMamba2.py:800-824), the export's tensors
            out.update({k: v for k, v in sd.items() if k.startswith(p) and not k.startswith((m + "in_proj.", m + "out_proj."))})
            s = lambda k: float(torch.as_tensor(sd[m + k]))  # noqa: E731
            splits = torch.tensor([s("norm.z_scale")] * E + [s("conv1d.x_scale")] * E + [s("conv1d.B_scale")] * GS
                                  + [s("conv1d.C_scale")] * GS + [s("qchunk_scan.dt_scale")] * H, dtype=torch.float32)
            lin_in = pack_given(w["in_proj.codes"], w["in_proj.group_scales"], w["in_proj.channel_scales"] / splits)
            lin_out = pack_given(w["out_proj.codes"], w["out_proj.group_scales"], w["out_proj.channel_scales"])
            lin_in["input_scale"] = torch.tensor(float(sd[p + "norm.output_scale"]))
            lin_out["input_scale"] = torch.tensor(s("had.x_H_scale"))
        else:  # the fp16 model's tensors (qMamba2.py:447-485), as the mode prepares them
            q = float_layer_mamba2(open_checkpoint(f).raw_layer(i), True, torch.float16)
            out.update({p + "norm.weight": torch.ones(256, dtype=torch.float16),
                        m + "conv1d.weight": q.conv_weight.to(torch.float16)[:, None], m + "conv1d.bias":
                        q.conv_bias.to(torch.float16), m + "dt_bias": q.dt_bias.to(torch.float16), m + "A_log": q.A_log.to(torch.float16),
                        m + "D": q.D, m + "norm.weight": q.gnorm_weight.to(torch.float16)})
            lin_in = pack_given(w["in_proj.codes"], w["in_proj.group_scales"], None)
            lin_out = pack_given(w["out_proj.codes"], w["out_proj.group_scales"], None)
        out.update({f"{m}in_proj.{k}": v for k, v in lin_in.items()})
        out.update({f"{m}out_proj.{k}": v for k, v in lin_out.items()})
    cfg["ssm_cfg"]["layer"] = f"{recipe}QMamba2"
    cfg["norm_cfg"] = {"norm": "QRMSNorm" if recipe == "W4A8" else "RMSNorm"}
    d = root / f"quamba2-f-{recipe.lower()}"
    if d.exists():
        return d
    d.mkdir()
    torch.save(out, d / "pytorch_model.bin")
    (d / "config.json").write_text(json.dumps(cfg))
    shutil.copy(TOKENIZER, d / "tokenizer.json")
    return d


@pytest.mark.parametrize("recipe", ["W4A8", "W4A16"])
def test_round_trip_through_a_w4_checkpoint_is_bit_identical(recipe, runs):
    root, f, cap, _, files = runs
    mode = f"q2-{recipe.lower()}"
    d = _w4_checkpoint(root, f, files[f"quamba2-{recipe.lower()}"], recipe)
    q, o = root / f"{recipe}-q.npz", root / f"{recipe}-o.npz"
    assert run_cli(capture_main, ["--model", d, "--mamba_model_path", f, "--modes", mode, "--output_file", q, *cap]) == 0
    assert run_cli(capture_main, ["--model", d, "--modes", mode, "--output_file", o, *cap]) == 0
    ref, got, own = (np.load(p) for p in (root / "f.npz", q, o))
    taps = [k for k in ref.files if k.startswith(f"mode_{mode}__")]
    assert len(taps) >= 28
    for k in taps:
        assert np.array_equal(ref[k], got[k]), k
    stats = json.loads(q.with_name(q.stem + "_stats.json").read_text())
    assert stats["provenance"]["calibration_by_prep"][f"quamba2-{recipe.lower()}"]["source"] == "checkpoint"
    pairing = stats["provenance"]["model"]["pairing"]
    assert pairing["matched"] and min(pairing["per_tensor"]["L1"].values()) == 1.0, pairing
    # without the float model the block's output is the same; W4A8's taps then come in the checkpoint's order
    assert np.array_equal(ref[f"mode_{mode}__L1.block.out"], own[f"mode_{mode}__L1.block.out"])
    if recipe == "W4A8":
        assert not np.array_equal(ref[f"mode_{mode}__L0.conv1d.x"], own[f"mode_{mode}__L0.conv1d.x"])


def test_match_nearest_takes_each_rows_most_similar_partner():
    from harness.recipes.quamba.q2.order import match_nearest

    g = torch.Generator().manual_seed(0)
    theirs = torch.randn(40, 64, generator=g)
    perm = torch.randperm(40, generator=g)
    ours = theirs[perm] * 3 + 0.05 * torch.randn(40, 64, generator=g)  # scaled (a channel scale), noisy (GPTQ)
    index, sim = match_nearest(ours, theirs)
    assert torch.equal(index, perm) and float(sim.min()) > 0.99
    ours[1] = theirs[perm[0]]  # two rows want the same partner: the closer keeps it, the other takes the next best
    index, _ = match_nearest(ours, theirs)
    assert index[1] == perm[0] and sorted(index.tolist()) == list(range(40))


@pytest.mark.parametrize("recipe", ["W4A8", "W4A16"])
def test_the_w4_export_is_the_hand_packed_checkpoint(recipe, runs):
    """`export --recipe w4a8|w4a16` (recipes.quamba.w4.export_mamba2, its own Marlin packing) writes, key for key and bit for bit,
    the checkpoint packed above with the test's packing from Quamba's source; capturing from it gives the mode's
    arrays from the float model."""
    root, f, cap, common, files = runs
    hand = _w4_checkpoint(root, f, files[f"quamba2-{recipe.lower()}"], recipe)
    out = root / f"export-{recipe.lower()}"
    assert run_cli(main, ["export", "--model", f, "--output_dir", out, "--recipe", recipe.lower(), "--quiet", *common]) == 0
    mine, theirs = (torch.load(d / "pytorch_model.bin", weights_only=True) for d in (out, hand))
    assert set(mine) == set(theirs)
    for k, v in theirs.items():
        assert type(mine[k]) is type(v), k
        if isinstance(v, torch.Tensor):
            assert mine[k].dtype == v.dtype and mine[k].shape == v.shape and torch.equal(mine[k], v), k
        else:
            assert mine[k] == v, k
    assert json.loads((out / "config.json").read_text()) == json.loads((hand / "config.json").read_text())
    mode = f"q2-{recipe.lower()}"
    q = root / f"export-{recipe}.npz"
    assert run_cli(capture_main, ["--model", out, "--mamba_model_path", f, "--modes", mode, "--output_file", q, *cap]) == 0
    ref, got = np.load(root / "f.npz"), np.load(q)
    for k in [k for k in ref.files if k.startswith(f"mode_{mode}__")]:
        assert np.array_equal(ref[k], got[k]), k
