"""Stored residual-stream tensors are un-rotated correctly for every Hadamard base.

A rotated mode runs on Had_D x; with --basis original the harness stores Had_D^T (Had_D x).
For the 20, 28 and 40 bases Had_D is not symmetric, so undoing it with Had_D instead of
its transpose would store wrong numbers; d_model = 20, 28 and 40 select those bases.
"""
import numpy as np
import pytest
import torch

from conftest import make_hf_model, write_hf_dir
from harness.kernels.hadamard import hadamard_factors, hadamard_matrix
from helpers import run_modes

# d_model -> its base (the symmetric 12 base and powers of two: test_fp_contracts)
D_MODELS = {20: 20, 28: 28, 40: 40}


def _hf_block0(model, ids):
    got = {}
    blk = model.backbone.layers[0]
    h1 = blk.register_forward_hook(lambda m, i, o: got.update(input=i[0], residual=o))
    h2 = blk.mixer.register_forward_hook(lambda m, i, o: got.update(output=o))
    with torch.no_grad():
        model(input_ids=torch.as_tensor(ids))
    h1.remove(), h2.remove()
    return {k: v[0].double().numpy() for k, v in got.items()}


@pytest.fixture(scope="module", params=sorted(D_MODELS), ids=lambda d: f"d_model={d}")
def rotated_run(request, tmp_path_factory):
    d_model = request.param
    assert hadamard_factors(d_model)[0] == D_MODELS[d_model]
    model = make_hf_model(vocab=4096, d_model=d_model, n_layer=1, d_state=4, seed=d_model)
    tmp = tmp_path_factory.mktemp(f"rot{d_model}")
    model_dir = write_hf_dir(tmp / "m", model)
    (tmp / "orig").mkdir(), (tmp / "rot").mkdir()
    original = run_modes(model_dir, tmp / "orig", ["fp32"], seq_len=16, cache=False)
    rotated = run_modes(model_dir, tmp / "rot", ["fp32"], seq_len=16, cache=False, basis="rotated")
    return d_model, model, original, rotated


def test_original_basis_equals_the_unrotated_model(rotated_run):
    d_model, model, original, _ = rotated_run
    arrays = original.by_mode["fp32"]
    ref = _hf_block0(model, original.token_ids)
    for name in ("input", "output", "residual"):
        got = arrays[name][0].astype(np.float64)
        err = np.linalg.norm(got - ref[name]) / np.linalg.norm(ref[name])
        assert err <= 1e-5, (d_model, name, err)


def test_rotated_basis_is_had_times_original(rotated_run):
    d_model, _, original, rotated = rotated_run
    H = hadamard_matrix(d_model).numpy()
    for name in ("input", "output", "residual"):
        orig = original.by_mode["fp32"][name][0].astype(np.float64)
        rot = rotated.by_mode["fp32"][name][0].astype(np.float64)
        np.testing.assert_allclose(rot, orig @ H.T, rtol=0, atol=2e-5 * np.abs(orig).max(), err_msg=name)
        if D_MODELS[d_model] in (20, 28, 40):  # the wrong inverse (Had instead of Had^T) is far off
            assert np.abs(rot @ H.T - orig).max() > 1e-2 * np.abs(orig).max()
