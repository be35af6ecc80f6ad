"""The number formats on the hybrids (the shipped Bamba, a seeded Nemotron-H) and on Mamba-2: weight_format and
act_format round every linear (the Mamba-2 blocks' in_proj / out_proj and the attention and MLP linears) and the
points Quamba2's W8A8 and the W8A8 linear recipe quantize; layers tables, the stats' layer_formats, decode;
state_format refused by name."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from conftest import ROOT
from harness.architectures.bamba.build import float_block
from harness.checkpoints.loading import open_checkpoint
from harness.cli import capture_main
from harness.kernels.formats import fake_quantize
from harness.modes import Q2_CALIBRATION_RECIPE
from harness.recipes.registry import get_mode, resolve_modes
from harness.runner.backbone import build_backbone
from harness.runner.weightbank import WeightBank
from harness.spec import FloatOut, FormatOut, SplitOut
from helpers import FAST_CLI, run_cli, run_modes

from bamba_fixtures import make_nemotron_h

BAMBA = ROOT / "models" / "bamba-tiny"
MODES = {"wa": {"base": "fp32", "weight_format": "mxfp4_e2m1", "act_format": "mxfp8_e4m3"},
         "a8": {"base": "fp32", "act_format": "fp8_e4m3"},
         "mix": {"base": "fp32", "layers": {"0-1": {"weight_format": "nvfp4"}, "2-": {"act_format": "mxfp6_e2m3"}}},
         "st": {"base": "fp32", "state_format": "bf16"}}


@pytest.fixture(scope="module")
def modes_file(tmp_path_factory):
    f = tmp_path_factory.mktemp("fmt") / "modes.json"
    f.write_text(json.dumps({"modes": MODES}))
    return f


def _on_grid(values, fmt: str) -> bool:
    t = torch.as_tensor(np.asarray(values, dtype=np.float32))
    return bool(torch.equal(fake_quantize(t, fmt), t))


def test_the_formats_reach_every_linear_of_a_hybrid(modes_file):
    """weight_format on in_proj / out_proj and q/k/v/o, gate/up/down; act_format at norm.out, each in_proj and conv
    split, out_proj's input, attn.out and mlp.hidden; a mode without formats builds the same specs as before."""
    bank = WeightBank(open_checkpoint(BAMBA))
    wa = resolve_modes(["wa"], modes_file, architecture="bamba")[0]
    blocks = build_backbone(wa, bank, None, 5).blocks
    plain = build_backbone(get_mode("fp32"), bank, None, 5).blocks
    fp32 = FloatOut(torch.float32)
    ssm, attn, mlp = blocks[0], blocks[2], blocks[1]
    for fmt_block, ref_block, names in ((ssm, plain[0], ("in_proj", "out_proj")),
                                        (attn, plain[2], ("q_proj", "k_proj", "v_proj", "o_proj")),
                                        (mlp, plain[1], ("gate_proj", "up_proj", "down_proj"))):
        for name in names:
            w, ref = getattr(fmt_block, name).weight, getattr(ref_block, name).weight
            assert torch.equal(w, fake_quantize(ref, "mxfp4_e2m1")) and not torch.equal(w, ref), name
    mx8 = FormatOut("mxfp8_e4m3")
    d = bank.dims
    gs = d.ngroups * d.d_state
    assert ssm.norm.out == mx8 and ssm.had.out == mx8 and ssm.gnorm.out == fp32  # rotated: the Hadamard's output
    # in_proj's dt split (nheads 12) is not a multiple of MX's 32: it keeps fp32
    assert ssm.in_proj.out == SplitOut((d.d_inner, d.conv_dim, d.nheads), (mx8, mx8, fp32))
    assert ssm.conv1d.out == SplitOut((d.d_inner, gs, gs), (mx8, mx8, mx8))
    assert attn.norm.out == mx8 and attn.mid == mx8 and attn.kv == (fp32, fp32) and attn.out == fp32
    assert mlp.norm.out == mx8 and mlp.mid == mx8
    assert plain[0].in_proj.out == fp32 and plain[0].conv1d.out == fp32 and plain[2].mid == fp32
    x = torch.randn(1, 7, d.d_model, generator=torch.Generator().manual_seed(2))
    want = float_block(Q2_CALIBRATION_RECIPE, bank.raw(2), d, 2)
    assert not torch.equal(attn(x)[1], want(x)[1])


def test_format_modes_run_end_to_end_and_decode_on_the_shipped_bamba(modes_file, tmp_path):
    result = run_modes(BAMBA, tmp_path, ["fp32", "wa", "a8", "mix"], layers=["all"], taps=["all"], seq_len=24,
                       end_to_end=True, decode=2, modes_file=modes_file)
    assert not result.failed
    kl = {m: r["kl"] for m, r in result.stats["end_to_end"].items()}
    assert kl["fp32"] == 0 < kl["a8"] < kl["wa"] < 0.05 and 0 < kl["mix"] < 0.05
    wa = result.by_mode["wa"]
    for point in ("L0.norm.out", "L0.in_proj.z", "L0.conv1d.B", "L0.had.out", "L2.norm.out", "L2.attn.out",
                  "L3.mlp.hidden"):
        assert _on_grid(wa[point], "mxfp8_e4m3") and not _on_grid(result.by_mode["fp32"][point], "mxfp8_e4m3"), point
    assert not _on_grid(wa["L2.attn.q"], "mxfp8_e4m3")  # q, k, v and the KV cache keep fp32
    mix = result.by_mode["mix"]
    assert _on_grid(mix["L2.norm.out"], "mxfp6_e2m3") and not _on_grid(mix["L0.norm.out"], "mxfp6_e2m3")
    formats = result.stats["modes"]["mix"]["layer_formats"]
    assert formats["0"]["weight_format"] == "nvfp4" and formats["4"]["act_format"] == "mxfp6_e2m3"
    assert formats["4"]["kept"] == ["in_proj.dt"] and formats["2"]["kept"] == []
    assert result.stats["modes"]["wa"]["decode"]["consistency"]["decode.logits"]["rel_l2"] < 1e-5


def test_nemotron_h_and_mamba2_run_the_formats(modes_file, tmp_path):
    d = tmp_path / "model"
    make_nemotron_h(d, vocab=4096, seed=6)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(ROOT / "models" / "mamba-tiny" / name, d / name)
    for model, out in ((d, tmp_path / "n"), (ROOT / "models" / "mamba2-tiny", tmp_path / "m")):
        out.mkdir()
        result = run_modes(model, out, ["fp32", "wa"], layers=["all"], taps=["all"], seq_len=16, end_to_end=True,
                           modes_file=modes_file)
        assert not result.failed
        kl = {m: r["kl"] for m, r in result.stats["end_to_end"].items()}
        assert kl["fp32"] == 0 < kl["wa"] < 0.2, (model, kl)
        assert _on_grid(result.by_mode["wa"]["L0.norm.out"], "mxfp8_e4m3")
    assert _on_grid(result.by_mode["wa"]["L0.conv1d.x"], "mxfp8_e4m3")  # mamba2-tiny


@pytest.mark.parametrize("model", [BAMBA, ROOT / "models" / "mamba2-tiny"])
def test_state_format_is_exit_2_on_mamba2_blocks(model, modes_file, tmp_path, capsys):
    code = run_cli(capture_main, ["--model", model, "--modes", "st", "--modes_file", modes_file,
                                  "--output_file", tmp_path / "c.npz", *FAST_CLI])
    err = capsys.readouterr().err
    assert code == 2 and "state_format is applied to Mamba-1 blocks only" in err and "Traceback" not in err, err
    assert "valid there: fp32, 1" in err and "wa, a8, mix" in err
