"""docs/spec/modes.md contracts 3-9, checked on every captured tap of a seeded model."""
import json

import numpy as np
import pytest
import torch

from conftest import make_hf_model, write_hf_dir
from harness.runner.backbone import build_backbone
from harness.recipes.quamba.families import calibrate_key as calibrate
from harness.emulation.capture import capture
from harness.checkpoints.text import DEFAULT_CALIB_FILE, calibration_windows
from harness.checkpoints.tokenizer import load_tokenizer
from harness.checkpoints.loading import open_checkpoint
from harness.recipes.registry import get_mode
from harness.kernels.quant import quantize
from harness.spec import Rounding
from harness.runner.weightbank import WeightBank
from helpers import FAST_CALIB, on_grid, run_modes

QUANT = ["0", "2-0", "2-1", "2-2", "2-3", "2-4", "3"]
BEFORE_SCAN = ["norm.out", "in_proj.out", "conv1d.in", "conv1d.out", "x_proj.in", "x_proj.out", "dt_proj.out"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_hf_dir(tmp_path_factory.mktemp("c") / "m48", make_hf_model(d_model=48, n_layer=2, d_state=16, seed=1))


@pytest.fixture(scope="module")
def outcome(model_dir, tmp_path_factory):
    return run_modes(model_dir, tmp_path_factory.mktemp("run"), ["all"], taps=["all"], layers=[0, 1], seq_len=96)


def _taps(outcome, mode, layer=0):
    return {k.split(".", 1)[1]: v for k, v in outcome.by_mode[mode].items() if k.startswith(f"L{layer}.")}


def _meta(outcome, mode, tensor):
    return outcome.stats["modes"][mode]["tensors"][tensor]


def _s_u(outcome, layer=0):
    return _meta(outcome, "0", f"L{layer}.ssm.u")["scale"]


def test_all_modes_ran(outcome):
    assert outcome.failed == []
    assert all(outcome.stats["modes"][m]["status"] == "ok" for m in ["fp32"] + QUANT)


@pytest.mark.parametrize("a,b", [("0", "2-0"), ("2-1", "2-2")])
def test_modes_meant_identical_are_bit_identical(outcome, a, b):
    """Contracts 3 and 4: every captured tensor, both layers."""
    assert outcome.by_mode[a].keys() == outcome.by_mode[b].keys()
    for name in outcome.by_mode[a]:
        assert np.array_equal(outcome.by_mode[a][name], outcome.by_mode[b][name]), name


def test_comparator_reports_the_identical_groups(outcome):
    groups = [set(g) for g in outcome.stats["comparison"]["identical_groups"]]
    assert any({"0", "2-0"} <= g for g in groups)
    assert any({"2-1", "2-2"} <= g for g in groups)
    assert not any({"0", "2-1"} <= g for g in groups)


def test_kernel_and_reference_scan_differ_exactly_at_the_scan(model_dir, tmp_path):
    """0 and 2-1 differ only in ssm_impl: equal before the scan, different at its output.

    The built-in modes round y to fp16, which hides most fp32-order differences on a
    small model, so the check uses user modes equal to 0 and 2-1 with fp32 activations.
    """
    modes_file = tmp_path / "modes.json"
    modes_file.write_text(json.dumps({"modes": {"k32": {"base": "0", "act_dtype": "fp32"},
                                                "r32": {"base": "2-1", "act_dtype": "fp32"}}}))
    out = run_modes(model_dir, tmp_path, ["k32", "r32"], taps=["all"], modes_file=modes_file, reference="k32")
    a, b = _taps(out, "k32"), _taps(out, "r32")
    for point in BEFORE_SCAN + ["ssm.u"]:
        assert np.array_equal(a[point], b[point]), point
    assert not np.array_equal(a["ssm.out"], b["ssm.out"])
    np.testing.assert_allclose(a["ssm.out"], b["ssm.out"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["0", "2-0", "2-1", "2-2"])
@pytest.mark.parametrize("layer", [0, 1])
def test_u_on_the_s_u_grid(outcome, mode, layer):
    """Contract 5."""
    u = _taps(outcome, mode, layer)["ssm.u"]
    meta = _meta(outcome, mode, f"L{layer}.ssm.u")
    assert meta["quantized"] and meta["scale"] == _s_u(outcome, layer)
    assert on_grid(u, meta["scale"])


@pytest.mark.parametrize("mode", ["2-4", "3"])
def test_u_is_the_unrounded_fp32_conv_output(outcome, mode):
    """Contract 6: u is the fp32 conv output (off the grid, unclipped); x_proj sees the RNE grid."""
    taps = _taps(outcome, mode)
    s_u = _s_u(outcome)
    assert not _meta(outcome, mode, "L0.ssm.u")["quantized"]
    assert np.array_equal(taps["ssm.u"], taps["conv1d.out"])
    assert not on_grid(taps["ssm.u"], s_u)
    xq = quantize(torch.from_numpy(taps["conv1d.out"]), s_u, Rounding.HALF_EVEN)
    assert np.array_equal(taps["x_proj.in"], xq.dequantize().numpy())
    assert on_grid(taps["x_proj.in"], s_u)
    beyond = np.abs(taps["conv1d.out"]) > 127.5 * s_u
    if beyond.any():  # the percentile clip applies to x_proj's input only
        assert np.abs(taps["ssm.u"]).max() > 127.5 * s_u


def test_2_3_requantizes_with_rne_and_differs_from_mode0_only_at_ties(outcome):
    """Contract 7."""
    t23, t0 = _taps(outcome, "2-3"), _taps(outcome, "0")
    s_u = _s_u(outcome)
    v = torch.from_numpy(t23["conv1d.out"])
    rne = quantize(v, s_u, Rounding.HALF_EVEN)
    assert np.array_equal(t23["ssm.u"], rne.dequantize().numpy())
    assert np.array_equal(t23["x_proj.in"], t23["ssm.u"])
    # same arithmetic as the int8 conv: its half-away rounding reproduces mode 0's codes exactly
    assert np.array_equal(quantize(v, s_u, Rounding.HALF_AWAY).dequantize().numpy(), t0["conv1d.out"])
    codes0 = np.round(t0["conv1d.out"].astype(np.float64) / s_u)
    differ = rne.codes.numpy() != codes0
    q = (v / torch.tensor(s_u, dtype=torch.float32)).numpy()  # the fp32 quotient both roundings see
    assert np.all(np.abs(q[differ] - np.trunc(q[differ])) == 0.5)


def test_mode3_conv_input_scale_follows_the_input(model_dir):
    """Contract 8: two inputs give two dynamic scales; in_proj's output is not on a grid."""
    ckpt = open_checkpoint(model_dir)
    bank = WeightBank(ckpt)
    tok = load_tokenizer(model_dir)
    windows = calibration_windows(tok, DEFAULT_CALIB_FILE, 4, 32, 0).ids
    cal = calibrate(bank, windows, FAST_CALIB, 0, ckpt.prefix_hashes(0), None)
    model = build_backbone(get_mode("3"), bank, cal.scales, 0)
    scales = []
    # in_proj is per token: inputs with disjoint token sets have different max|x|
    for ids in (torch.arange(10, 42).unsqueeze(0), torch.arange(500, 532).unsqueeze(0)):
        with capture(model, ["L0.conv1d.in", "L0.in_proj.out"]) as got:
            model(ids)
        scales.append(got["L0.conv1d.in"].scale)
        assert not got["L0.in_proj.out"].quantized
        assert not on_grid(got["L0.in_proj.out"].values.numpy(), cal.scales[0].s_xz)
    assert scales[0] != scales[1]


@pytest.mark.parametrize("mode", QUANT)
def test_every_quantized_mode_differs_from_fp32(outcome, mode):
    """Contract 9."""
    for name in ("output", "L1.block.out"):
        assert not np.array_equal(outcome.by_mode[mode][name], outcome.by_mode["fp32"][name])


def test_quantized_taps_record_scale_and_saturation(outcome):
    meta = _meta(outcome, "0", "L0.in_proj.out")
    assert meta["quantized"] and meta["kind"] == "int8"
    assert 0.0 <= meta["saturated_fraction"] <= 1.0 and meta["clipped_fraction"] is not None
    assert _meta(outcome, "fp32", "L0.in_proj.out")["quantized"] is False
