"""SmQ-SSM (harness.recipes.smq): the smoothing points and their quantizers on crafted inputs, the transform-only
variant equal to fp32, alpha as an option checked before any work, and runs on the shipped Mamba-1."""
import json

import numpy as np
import pytest
import torch

from harness.cli import capture_main
from harness.checkpoints.loading import open_checkpoint
from harness.emulation.modules import EmuBackbone
from harness.kernels.fakequant import fq_sym, fq_sym_dynamic
from harness.kernels.field_transforms import smooth_factors
from harness.recipes.registry import get_mode
from harness.recipes.smq import calibrate_smq
from harness.recipes.smq.blocks import Q1_POINTS, build
from harness.runner.calibration import CalibrationSettings
from harness.runner.weightbank import WeightBank
from conftest import ROOT, SHIPPED
from helpers import FAST_CLI, run_cli, run_modes

SETTINGS = CalibrationSettings(num_samples=4, seqlen=16, batch_size=2)


@pytest.fixture(scope="module")
def calibrated(hf_dir):
    bank = WeightBank(open_checkpoint(hf_dir))
    windows = torch.randint(0, bank.dims.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    n = bank.dims.n_layer
    return bank, windows, calibrate_smq(get_mode("smq-ssm"), bank, windows, SETTINGS, n - 1, [], None)


def test_smoothing_vectors_are_smoothquants_of_the_unsmoothed_channel_absmax(calibrated):
    bank, windows, calib = calibrated
    layer0 = calib.scales[0]
    # the norm output (in_proj's input) per channel, observed independently
    from harness.architectures.registry import get_architecture
    blocks = get_architecture("mamba1").build_blocks(get_mode("smq-ssm"), bank, None, 0, False)
    seen = []
    blocks[0].norm.register_forward_hook(lambda _m, _i, out: seen.append(out.abs().reshape(-1, out.shape[-1]).amax(0)))
    model = EmuBackbone(lambda ids: bank.embed(ids, False, torch.float32), blocks)
    for batch in windows.split(2):
        model(batch)
    amax = torch.stack(seen).amax(0)
    expected = smooth_factors(amax, bank.layer(0, "fp32", False, "exact").in_proj, 0.5)
    assert torch.equal(layer0["s_mamba_in"], expected)
    assert set(Q1_POINTS) <= set(layer0) and all(layer0[p] > 0 for p in Q1_POINTS)


def test_smoothed_in_proj_quantizes_x_over_s_against_the_smoothed_weight(calibrated):
    bank, _, calib = calibrated
    block = build(get_mode("smq-ssm"), bank, calib.scales, 0, quantize=True)[0]
    s, sc = calib.scales[0]["s_mamba_in"], calib.scales[0]["mamba_in"]
    w = fq_sym_dynamic(bank.layer(0, "fp32", False, "exact").in_proj * s[None, :])
    assert torch.equal(block.in_proj.inner.weight, w)
    x = torch.randn(1, 6, bank.dims.d_model, generator=torch.Generator().manual_seed(5))
    assert torch.equal(block.in_proj(x), fq_sym(x / s, sc) @ w.T)
    # u: q(u / s) * s for the scan, q(u / s) (to rounding) for x_proj, whose weight absorbed s
    u = torch.randn(1, 6, bank.dims.d_inner)
    s_u = calib.scales[0]["s_u"]
    assert torch.equal(block.conv1d.out_fn(u), fq_sym(u / s_u, calib.scales[0]["u"]) * s_u)


def _rel_l2(a, b):
    return float(torch.linalg.vector_norm((a - b).double()) / torch.linalg.vector_norm(b.double()))


def test_transform_only_variant_equals_fp32(calibrated):
    bank, windows, calib = calibrated
    depth = bank.dims.n_layer - 1
    from harness.architectures.registry import get_architecture
    ref = EmuBackbone(lambda ids: bank.embed(ids, False, torch.float32),
                      get_architecture("mamba1").build_blocks(get_mode("smq-ssm"), bank, None, depth, False))
    smooth = EmuBackbone(lambda ids: bank.embed(ids, False, torch.float32),
                         build(get_mode("smq-ssm+transform"), bank, calib.scales, depth, quantize=False))
    quant = EmuBackbone(lambda ids: bank.embed(ids, False, torch.float32),
                        build(get_mode("smq-ssm"), bank, calib.scales, depth, quantize=True))
    ids = torch.randint(0, bank.dims.vocab_size, (1, 32), generator=torch.Generator().manual_seed(9))
    r = ref(ids)
    assert _rel_l2(smooth(ids), r) <= 1e-5
    assert _rel_l2(quant(ids), r) > 1e-4  # the quantized mode is not the identity


def _modes_file(path, alpha):
    path.write_text(json.dumps({"modes": {"smq-a": {"base": "smq-ssm", "options": {"alpha": alpha}}}}))
    return path


@pytest.mark.parametrize("alpha", [0.0, 1.0, 1.5, -0.2, "x"])
def test_alpha_outside_0_1_exits_2_before_any_work(alpha, hf_dir, tmp_path, capsys):
    out = tmp_path / "o.npz"
    rc = run_cli(capture_main, ["--model", hf_dir, "--modes", "smq-a", "--modes_file",
                                _modes_file(tmp_path / "m.json", alpha), "--output_file", out, *FAST_CLI])
    err = capsys.readouterr().err
    assert rc == 2 and "alpha" in err and "(0, 1)" in err.replace("0 < alpha < 1", "(0, 1)") and not out.exists()
    assert "Traceback" not in err


def test_alpha_is_a_knob_with_its_own_calibration(hf_dir, tmp_path):
    out = run_modes(hf_dir, tmp_path, ["smq-ssm", "smq-a"], seq_len=16,
                    modes_file=_modes_file(tmp_path / "m.json", 0.8))
    by = out.stats["provenance"]["calibration_by_prep"]
    assert set(by) == {"smq-ssm@alpha=0.5", "smq-ssm@alpha=0.8"}
    assert by["smq-ssm@alpha=0.8"]["options"] == {"alpha": 0.8}
    assert {"s_mamba_in", "s_u", "s_dt_proj_in", "s_ssm_out"} <= set(by["smq-ssm@alpha=0.5"]["statistics"][0])
    assert out.stats["modes"]["smq-a"]["recipe"]["options"] == {"alpha": "0.8"}
    assert not np.array_equal(out.by_mode["smq-ssm"]["output"], out.by_mode["smq-a"]["output"])
    again = run_modes(hf_dir, tmp_path, ["smq-ssm"], seq_len=16)
    assert again.stats["provenance"]["calibration_by_prep"]["smq-ssm@alpha=0.5"]["source"] == "reused"


def test_on_the_shipped_model_and_refused_on_mamba2(tmp_path, capsys):
    out = run_modes(SHIPPED, tmp_path, ["fp32", "smq-ssm", "smq-ssm+transform"], seq_len=32, layers=[0, 1, 2],
                    end_to_end=True)
    assert all(out.stats["modes"][m]["status"] == "ok" for m in ("smq-ssm", "smq-ssm+transform"))
    o, t = out.by_mode["smq-ssm+transform"]["output"], out.by_mode["fp32"]["output"]
    assert np.linalg.norm(o - t) / np.linalg.norm(t) <= 1e-5
    rc = run_cli(capture_main, ["--model", ROOT / "models" / "mamba2-tiny", "--modes", "smq-ssm", "--output_file",
                                tmp_path / "m2.npz", *FAST_CLI])
    err = capsys.readouterr().err
    assert rc == 2 and "smq-ssm" in err and "Mamba-1" in err and not (tmp_path / "m2.npz").exists()
