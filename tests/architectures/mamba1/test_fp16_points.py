"""Every fp16 rounding point of every mode: a value leaves a site on the fp16 grid exactly where the recipe says.

For each built-in mode one block runs on real (calibrated) scales with every tap
captured; each float-valued tap must be on the fp16 grid (v == f16(v)) if and only
if it is listed in FP16_POINTS. Int8 taps (codes * scale) are not float outputs and
are skipped. Issue 11 adds fp16 rounding points (weight preparation, calibration's
conv output); update the rows it changes.
"""
import pytest
import torch

from harness.runner.backbone import build_backbone
from harness.emulation.capture import capture, point_name
from harness.modes import BUILTIN_MODES
from harness.emulation.modules import BLOCK_POINTS
from helpers import observed_bank

# mode -> points whose float value is rounded to fp16 (every other float point must not be on the grid)
_INT8_PIPE = {"block.in", "ssm.out", "out_proj.out", "block.out"}
FP16_POINTS = {
    "fp32": set(),
    "1": {"block.in", "norm.out", "in_proj.out", "conv1d.in", "x_proj.out", "dt_proj.out", "ssm.out",
          "out_proj.out", "block.out"},                 # the conv output stays fp32 (FloatOut(fp32))
    "0": _INT8_PIPE, "2-0": _INT8_PIPE, "2-1": _INT8_PIPE, "2-2": _INT8_PIPE, "2-3": _INT8_PIPE, "2-4": _INT8_PIPE,
    "3": _INT8_PIPE | {"in_proj.out"},                 # in_proj's float output is fp16
}


@pytest.fixture(scope="module")
def setup(hf_dir):
    bank, scales, ids = observed_bank(hf_dir, 24)
    return bank, scales, ids


def _on_fp16_grid(v: torch.Tensor) -> bool:
    return torch.equal(v, v.half().float())


@pytest.mark.parametrize("mode", sorted(FP16_POINTS))
def test_fp16_rounding_points(setup, mode):
    bank, scales, ids = setup
    recipe = BUILTIN_MODES[mode]
    model = build_backbone(recipe, bank, scales if recipe.needs_calibration else None, 0)
    names = [point_name(0, p) for p in BLOCK_POINTS]
    with capture(model, names) as got:
        model(ids)
    checked = set()
    for point in BLOCK_POINTS:
        cap = got.get(point_name(0, point))
        if cap is None or cap.codes is not None:
            continue  # absent (no Hadamard without rotation) or int8
        checked.add(point)
        assert _on_fp16_grid(cap.values) == (point in FP16_POINTS[mode]), (mode, point)
    assert FP16_POINTS[mode] <= checked
    assert "block.residual" in checked and "ssm.state" in checked  # fp32 sums and the fp32 state


# prepared weights rounded to the weight dtype; A_log and D stay fp32 as mamba keeps them (weights.float_layer)
FP16_WEIGHTS = {"in_proj", "conv_weight", "conv_bias", "x_proj", "dt_proj", "dt_bias", "out_proj", "norm_weight"}


@pytest.mark.parametrize("rotate", [True, False])
def test_fp16_points_of_weight_preparation(setup, rotate):
    bank, _, ids = setup
    for weights in ("fp16", "fp32"):
        params = bank.layer(0, weights, rotate)
        for name in FP16_WEIGHTS | {"A_log", "D"}:
            value = getattr(params, name)
            if value is None:
                assert name == "norm_weight" and rotate   # folded into in_proj
                continue
            want = weights == "fp16" and name in FP16_WEIGHTS
            assert _on_fp16_grid(value) == want, (weights, rotate, name)
        emb = bank.embed(ids, rotate, torch.float16 if weights == "fp16" else torch.float32)
        assert _on_fp16_grid(emb) == (weights == "fp16")
