"""The block's data flow: EmuMambaBlock.forward against the same sub-modules composed by hand, and mode fp32
against transformers' own mixer (block level, no pipeline)."""
import numpy as np
import pytest
import torch

from harness.architectures.mamba1.build import build_block
from harness.emulation.capture import capture, point_name
from harness.modes import BUILTIN_MODES
from harness.emulation.modules import BLOCK_POINTS
from harness.kernels.hadamard import hadamard_transform
from harness.kernels.quant import dequantize
from helpers import observed_bank


@pytest.fixture(scope="module")
def setup(hf_dir):
    bank, scales, ids = observed_bank(hf_dir, 20)
    return bank, scales[0], ids


def _block(bank, scales, mode):
    recipe = BUILTIN_MODES[mode]
    params = bank.layer(0, recipe.weights, recipe.rotate == "yes")
    block = build_block(recipe, params, scales if recipe.needs_calibration else None, bank.ckpt.dims, 0)
    return block, recipe


def by_hand(block, residual):
    """The block's forward written out from its own sub-modules, in the order of spec notes §2.6."""
    dims = block.dims
    normed = block.norm(residual)
    xz = block.in_proj(normed)
    x, z = xz.split([dims.d_inner, dims.d_inner]) if hasattr(xz, "codes") else xz.split(dims.d_inner, dim=-1)
    conv_out = block.conv1d(block.conv1d.quantize_input(x))
    dbl = block.x_proj(block._xproj_input(conv_out))
    sizes = [dims.dt_rank, dims.d_state, dims.d_state]
    dt, B, C = dbl.split(sizes) if hasattr(dbl, "codes") else dbl.split(sizes, dim=-1)
    delta = block.dt_proj(dt)
    y, state = block.ssm(block._ssm_u(conv_out), delta, B, C, z)
    if block.had is not None:
        y = block.had(y)
    out = dequantize(block.out_proj(y))
    return out, residual + out, state


@pytest.mark.parametrize("mode", ["0", "2-0", "2-3", "2-4", "3", "1", "fp32"])
def test_forward_is_the_documented_composition(setup, mode):
    bank, scales, ids = setup
    block, recipe = _block(bank, scales, mode)
    residual = bank.embed(ids, recipe.rotate == "yes", torch.float16 if recipe.act_dtype == "fp16" else torch.float32)
    with capture(block, [point_name(0, p) for p in BLOCK_POINTS]) as got:
        out, new_residual = block(residual)
    want_out, want_residual, want_state = by_hand(block, residual)
    assert torch.equal(out, want_out) and torch.equal(new_residual, want_residual)
    assert torch.equal(got["L0.block.in"].values, residual)
    assert torch.equal(got["L0.block.out"].values, out) and torch.equal(got["L0.out_proj.out"].values, out)
    assert torch.equal(got["L0.block.residual"].values, new_residual)
    assert torch.equal(got["L0.ssm.state"].values, want_state)
    assert got["L0.ssm.state"].values.shape == (1, bank.ckpt.dims.d_inner, bank.ckpt.dims.d_state)
    assert ("L0.had.out" in got) == (recipe.rotate == "yes")


def test_fp32_block_equals_the_transformers_mixer(setup, hf_model):
    bank, scales, ids = setup
    block, _ = _block(bank, scales, "fp32")
    residual = bank.embed(ids, True, torch.float32)
    out, new_residual = block(residual)
    got = {}
    layer = hf_model.backbone.layers[0]
    hook = layer.mixer.register_forward_hook(lambda m, i, o: got.update(mixer=o))
    with torch.no_grad():
        hf_model(input_ids=ids)
    hook.remove()
    ref = got["mixer"].double()
    unrotated = hadamard_transform(out, transpose=True)
    err = float((unrotated - ref).norm() / ref.norm())
    assert err <= 1e-5, err
    np.testing.assert_array_equal(new_residual.numpy(), (residual + out).numpy())


def test_a_quantizing_mode_without_scales_is_refused_by_name(hf_dir):
    """build_backbone refuses a mode that quantizes activations when no scales are given, naming the mode (a
    mutant that raised a bare ValueError survived)."""
    from harness.runner.backbone import build_backbone
    from harness.checkpoints.loading import open_checkpoint
    from harness.recipes.registry import get_mode
    from harness.runner.weightbank import WeightBank
    with pytest.raises(ValueError, match=r"^mode '2-4' quantizes activations and needs calibrated scales$"):
        build_backbone(get_mode("2-4"), WeightBank(open_checkpoint(hf_dir)), None, 0)
