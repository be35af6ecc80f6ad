"""The naive W8A8 baselines on a hybrid: the Mamba-2 blocks quantized as on Mamba-2 (static scales observed through
the whole fp32 model, attention and MLP included), the attention and MLP blocks the unrotated fp32 float blocks."""
from __future__ import annotations

import shutil

import pytest
import torch

from conftest import ROOT
from harness.checkpoints.loading import open_checkpoint
from harness.emulation.fakequant import Wrap
from harness.recipes.naive import calibrate_static
from harness.recipes.naive.blocks import STATIC_POINTS, build_dynamic, build_static, float_blocks
from harness.recipes.registry import get_mode
from harness.runner.calibration import CalibrationSettings
from harness.runner.weightbank import WeightBank
from helpers import run_modes

from bamba_fixtures import make_nemotron_h

BAMBA = ROOT / "models" / "bamba-tiny"
SETTINGS = CalibrationSettings(num_samples=4, seqlen=16, batch_size=2)


def test_naive_quantizes_the_mamba2_blocks_and_keeps_attention_and_mlp_fp32():
    bank = WeightBank(open_checkpoint(BAMBA))
    depth = bank.dims.n_layer - 1
    windows = torch.randint(0, bank.dims.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    calib = calibrate_static(bank, windows, SETTINGS, depth, [], None)
    kinds = bank.dims.kinds
    for layer, kind in enumerate(kinds):
        assert (set(calib.scales[layer]) == set(STATIC_POINTS["mamba2"])) if kind == "ssm" else calib.scales[layer] == {}
    x = torch.randn(1, 9, bank.dims.d_model, generator=torch.Generator().manual_seed(1))
    for name, blocks in (("naive-static", build_static(get_mode("naive-static"), bank, calib.scales, depth)),
                         ("naive-dynamic", build_dynamic(get_mode("naive-dynamic"), bank, depth))):
        fp32 = float_blocks(get_mode(name), bank, depth)
        for layer, (block, ref) in enumerate(zip(blocks, fp32)):
            if kinds[layer] == "ssm":
                assert isinstance(block.in_proj, Wrap) and len(torch.unique(block.in_proj.inner.weight)) <= 255
                got, want = block(x)[1], ref(x)[1]
                assert not torch.equal(got, want) and float((got - want).norm() / want.norm()) < 0.05, (name, layer)
            else:
                assert torch.equal(block(x)[1], ref(x)[1]), (name, layer)


@pytest.mark.parametrize("model", ["bamba", "nemotron_h"])
def test_naive_runs_end_to_end_on_the_hybrids(model, tmp_path):
    if model == "bamba":
        d = BAMBA
    else:
        d = tmp_path / "model"
        make_nemotron_h(d, vocab=4096, seed=6)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(ROOT / "models" / "mamba-tiny" / name, d / name)
    result = run_modes(d, tmp_path, ["fp32", "naive-static", "naive-dynamic"], layers=["all"], seq_len=16,
                       end_to_end=True, decode=2)
    assert not result.failed
    kl = {m: r["kl"] for m, r in result.stats["end_to_end"].items()}
    assert kl["fp32"] == 0 < kl["naive-static"] < 0.1 and 0 < kl["naive-dynamic"] < 0.1, kl
    cons = result.stats["modes"]["naive-static"]["decode"]["consistency"]["decode.logits"]
    assert cons["rel_l2"] < 1e-5  # static scales: the step computes the prefill's values
