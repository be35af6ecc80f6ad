"""docs/spec/modes.md contracts 1 and 2: the floating-point modes against transformers' own forward."""
import numpy as np
import pytest
import torch

from helpers import run_modes


def _rel_l2(a, b):
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b))


def _hf_layer_io(model, ids, layer):
    """Block input, mixer output and residual after the block, from transformers' MambaForCausalLM."""
    got = {}
    blk = model.backbone.layers[layer]
    h1 = blk.register_forward_hook(lambda m, i, o: got.update(block_in=i[0], residual=o))
    h2 = blk.mixer.register_forward_hook(lambda m, i, o: got.update(mixer=o))
    with torch.no_grad():
        model(input_ids=torch.as_tensor(ids))
    h1.remove(), h2.remove()
    return {k: v.double().numpy() for k, v in got.items()}


@pytest.fixture(scope="module")
def fp_run(hf_dir, tmp_path_factory):
    return run_modes(hf_dir, tmp_path_factory.mktemp("fp"), ["fp32", "1"], layers=[0, 1], seq_len=48)


@pytest.mark.parametrize("layer", [0, 1])
def test_fp32_equals_transformers_forward(fp_run, hf_model, layer):
    arrays = fp_run.by_mode["fp32"]
    ref = _hf_layer_io(hf_model, fp_run.token_ids, layer)
    names = ("input", "output", "residual") if layer == 0 else (f"L{layer}.block.in", f"L{layer}.block.out",
                                                                 f"L{layer}.block.residual")
    for name, key in zip(names, ("block_in", "mixer", "residual")):
        assert _rel_l2(arrays[name], ref[key]) <= 1e-5, name
    assert fp_run.token_ids.shape == (1, 48)


def test_mode1_equals_fp32_within_fp16_rounding(fp_run):
    a, b = fp_run.by_mode["1"], fp_run.by_mode["fp32"]
    for name in ("input", "output", "residual", "L1.block.out"):
        err = _rel_l2(a[name], b[name].astype(np.float64))
        assert 0 < err < 5e-3, (name, err)   # fp16 has 2**-11 = 4.9e-4 relative precision per rounding


def test_rotation_is_undone_in_the_stored_basis(fp_run, hf_model):
    emb = hf_model.backbone.embeddings.weight.detach().numpy()[fp_run.token_ids[0]]
    np.testing.assert_allclose(fp_run.by_mode["fp32"]["input"][0], emb, rtol=0, atol=1e-6)
    assert fp_run.stats["provenance"]["basis"] == "original"
