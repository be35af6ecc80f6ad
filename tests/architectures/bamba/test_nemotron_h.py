"""Nemotron-H, the second hybrid family: one block per layer (Mamba-2, attention without RoPE, ReLU^2 MLP), fp32
against transformers' NemotronHForCausalLM per layer, for the logits and in cached decoding, and the hybrid recipes
through a run."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from conftest import ROOT
from harness.checkpoints.loading import ModelDirError, open_checkpoint
from harness.emulation.capture import capture
from harness.recipes.registry import get_mode
from harness.runner.backbone import build_backbone
from harness.runner.forwards import _to_original, build_head
from harness.runner.weightbank import WeightBank
from helpers import run_modes

from bamba_fixtures import make_nemotron_h

SEQ = 21  # chunk_size 8: two chunk boundaries inside the sample


def rel(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("nemotron") / "tf"
    return make_nemotron_h(out, seed=2), out


def _ids(seed: int = 5, n: int = SEQ) -> torch.Tensor:
    return torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(seed))


def test_a_nemotron_h_directory_is_read_as_its_own_hybrid(model):
    d = open_checkpoint(model[1]).dims
    assert d.architecture == "nemotron_h" and d.kinds == ("ssm", "mlp", "attention", "mlp", "ssm", "mlp")
    assert (d.n_layer, d.rope_dim, d.mlp_act, d.d_inner, d.nheads) == (6, 0, "relu2", 64, 8)


@pytest.mark.parametrize("mode", ["fp32", "1"])
def test_float_equals_transformers_per_layer_and_logits(model, mode):
    hf, path = model
    ids = _ids()
    layers = []
    hooks = [layer.register_forward_hook(lambda m, i, o: layers.append(o.detach())) for layer in hf.model.layers]
    with torch.no_grad():
        t_logits = hf(ids).logits
    for h in hooks:
        h.remove()
    recipe = get_mode(mode)
    bank = WeightBank(open_checkpoint(path))
    n = bank.dims.n_layer
    backbone = build_backbone(recipe, bank, None, n - 1)
    with capture(backbone, [f"L{i}.block.residual" for i in range(n)]) as cap:
        residual = backbone(ids)
    tol = 1e-5 if mode == "fp32" else 3e-2
    for i in range(n):
        got = _to_original(cap[f"L{i}.block.residual"].values, recipe.rotate == "yes")
        assert rel(got, layers[i]) <= tol, (i, rel(got, layers[i]))
    assert rel(build_head(recipe, bank)(residual), t_logits) <= tol


def test_fp32_step_is_transformers_cached_decoding(model):
    hf, path = model
    prompt, steps = 11, 4
    ids = _ids(9, prompt + steps)
    bank = WeightBank(open_checkpoint(path))
    ours, head = build_backbone(get_mode("fp32"), bank, None, bank.dims.n_layer - 1), build_head(get_mode("fp32"), bank)
    with torch.no_grad():
        out = hf(input_ids=ids[:, :prompt], use_cache=True)
        cache = out.past_key_values
        _, states = ours.prefill(ids[:, :prompt])
        for k in range(prompt, prompt + steps):
            out = hf(input_ids=ids[:, k:k + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            residual, states = ours.step(ids[:, k:k + 1], states)
            assert rel(head(residual)[:, 0], out.logits[:, -1]) <= 1e-5, k


def test_the_hybrid_recipes_run_and_moe_is_refused(model, tmp_path):
    hf, path = model
    d = tmp_path / "model"
    shutil.copytree(path, d)
    big = make_nemotron_h(tmp_path / "big", vocab=4096, seed=4)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(ROOT / "models" / "mamba-tiny" / name, tmp_path / "big" / name)
    (tmp_path / "out").mkdir()
    result = run_modes(tmp_path / "big", tmp_path / "out", ["fp32", "quant_only"], layers=["all"], taps=["all"],
                       seq_len=16, end_to_end=True)
    assert list(result.by_mode) == ["fp32", "q2-w8a8", "q2-w8a8-a8", "q2-w8a8-a8-kv8", "q2-w8a8-a8-kvfp8"]
    assert not result.failed and "L1.mlp.gate" not in result.by_mode["fp32"] and "L1.mlp.up" in result.by_mode["fp32"]
    with torch.no_grad():
        ref = big(input_ids=torch.as_tensor(result.token_ids)).logits.numpy()
    logits = result.by_mode["fp32"]["logits"]
    assert np.linalg.norm(logits.reshape(ref.shape) - ref) / np.linalg.norm(ref) <= 1e-5
    kl = {m: r["kl"] for m, r in result.stats["end_to_end"].items()}
    assert kl["fp32"] == 0 < kl["q2-w8a8"] < 0.1 and all(0 < v < 0.2 for v in kl.values() if v)
    cfg = json.loads((d / "config.json").read_text())
    cfg["layers_block_type"][1] = "moe"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelDirError, match="layer kind.s. 'moe' are not supported"):
        open_checkpoint(d)
