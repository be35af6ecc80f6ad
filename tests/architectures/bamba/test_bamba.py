"""Bamba (the Granite 4.0-H hybrid layout): read as its own architecture, its blocks the decoder layers'
sublayers (Mamba-2 or attention, then the MLP), fp32 against transformers' BambaForCausalLM per sublayer and for
the logits with chunk boundaries inside the sample, the attention and MLP capture points, and what it refuses."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from harness.checkpoints.loading import ModelDirError, open_checkpoint
from harness.emulation.capture import ATTENTION_POINTS, MLP_POINTS, capture
from harness.recipes.registry import get_mode
from harness.runner.backbone import build_backbone
from harness.runner.forwards import _to_original, build_head
from harness.runner.weightbank import WeightBank

from bamba_fixtures import make_bamba

SEQ = 21  # mamba_chunk_size 8: two chunk boundaries inside the sample and a partial last chunk


def rel(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module", params=[((1,), False), ((0, 2), True)], ids=["attn1-untied", "attn02-tied"])
def model(request, tmp_path_factory):
    attn, tie = request.param
    out = tmp_path_factory.mktemp("bamba") / "tf"
    return make_bamba(out, layers=3, attn=attn, tie=tie, seed=len(attn)), out


def _ids(seed: int = 5, n: int = SEQ) -> torch.Tensor:
    return torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(seed))


def _transformers_run(hf, ids):
    """Per sublayer, the residual after it (the mixer's: input + mixer output; the layer's output), and the logits."""
    after = []
    hooks = []
    for layer in hf.model.layers:
        mixer = layer.mamba if layer.block_type == "linear_attention" else layer.self_attn
        hooks.append(mixer.register_forward_hook(lambda m, i, o: after.append(("mixer", o[0] if isinstance(o, tuple) else o))))
        hooks.append(layer.register_forward_hook(lambda m, i, o: after.append(("layer", o[0] if isinstance(o, tuple) else o))))
    with torch.no_grad():
        logits = hf(ids).logits
    for h in hooks:
        h.remove()
    return [t.detach() for _, t in after], logits


def _harness_run(path, mode: str, ids, points=("block.out", "block.residual")):
    recipe = get_mode(mode)
    bank = WeightBank(open_checkpoint(path))
    n = bank.dims.n_layer
    backbone = build_backbone(recipe, bank, None, n - 1)
    with capture(backbone, [f"L{i}.{p}" for i in range(n) for p in points]) as cap:
        residual = backbone(ids)
    rot = recipe.rotate == "yes"
    basis = lambda p, x: _to_original(x, rot) if p.startswith("block.") else x  # noqa: E731
    got = {p: [basis(p, cap[f"L{i}.{p}"].values) if f"L{i}.{p}" in cap else None for i in range(n)] for p in points}
    return bank.dims, got, build_head(recipe, bank)(residual)


def test_a_bamba_directory_is_read_as_a_hybrid(model):
    hf, path = model
    ckpt = open_checkpoint(path)
    d = ckpt.dims
    attn = hf.config.attn_layer_indices
    assert d.architecture == "bamba" and d.n_layer == 6 and d.chunk_size == 8 < SEQ
    assert d.kinds == tuple(k for i in range(3) for k in ("attention" if i in attn else "ssm", "mlp"))
    assert (d.n_heads, d.n_kv_heads, d.head_dim, d.rope_dim, d.d_ff) == (4, 2, 8, 4, 48)


@pytest.mark.parametrize("mode", ["fp32", "1"])
def test_float_equals_transformers_per_sublayer_and_logits(model, mode):
    """fp32 (rotated residual stream) within 1e-5 of transformers' fp32 forward, per sublayer and for the logits;
    mode 1 (fp16 weights and activations) close to it."""
    hf, path = model
    ids = _ids()
    t_blocks, t_logits = _transformers_run(hf, ids)
    dims, got, logits = _harness_run(path, mode, ids)
    tol = 1e-5 if mode == "fp32" else 3e-2
    # transformers' mixer hook gives the mixer output; the harness's block.residual after block 2i is input + it
    for b in range(dims.n_layer):
        if b % 2:
            assert rel(got["block.residual"][b], t_blocks[b]) <= tol, (b, rel(got["block.residual"][b], t_blocks[b]))
        else:
            assert rel(got["block.out"][b], t_blocks[b]) <= tol, (b, rel(got["block.out"][b], t_blocks[b]))
    assert rel(logits, t_logits) <= tol


def test_attention_and_mlp_points(model):
    hf, path = model
    ids = _ids()
    points = tuple(p for p in {**ATTENTION_POINTS, **MLP_POINTS} if not p.startswith("block."))
    dims, got, _ = _harness_run(path, "1", ids, points)
    for b, kind in enumerate(dims.kinds):
        have = {p for p in points if got[p][b] is not None}
        want = {"attention": set(ATTENTION_POINTS), "mlp": set(MLP_POINTS), "ssm": {"norm.out"}}[kind]
        assert have == want & set(points), (b, kind)
    b = dims.kinds.index("attention")
    p = got["attn.scores"][b].double()
    assert p.shape == (1, 4, SEQ, SEQ) and torch.allclose(p.sum(-1), torch.ones(1, 4, SEQ, dtype=torch.float64), atol=1e-2)
    assert float(p.triu(1).abs().max()) == 0.0  # causal
    assert got["attn.k"][b].shape == got["attn.v"][b].shape == (1, SEQ, 2, 8)  # the sequence axis second


def test_unknown_and_unsupported_hybrids_are_refused(model, tmp_path):
    _, path = model
    for edit, message in (({"model_type": "zamba2", "architectures": ["Zamba2ForCausalLM"]},
                           "model_type .zamba2. is not supported; supported model types: .*bamba, nemotron_h"),
                          ({"attention_bias": True}, "attention_bias is not supported"),
                          ({"hidden_act": "gelu"}, "hidden_act='gelu' .SiLU only. is not supported")):
        d = tmp_path / f"m{len(list(tmp_path.iterdir()))}"
        shutil.copytree(path, d)
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(edit)
        (d / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ModelDirError, match=message):
            open_checkpoint(d)


def test_fp32_step_is_transformers_cached_decoding(model):
    """The prefill over a prompt longer than a chunk, then one token a step: the Mamba-2 states and the attention's
    KV cache stepped together, the logits within 1e-5 of transformers' cached decoding (HybridMambaAttention cache)."""
    hf, path = model
    prompt, steps = 11, 5
    ids = _ids(9, prompt + steps)
    bank = WeightBank(open_checkpoint(path))
    ours, head = build_backbone(get_mode("fp32"), bank, None, bank.dims.n_layer - 1), build_head(get_mode("fp32"), bank)
    with torch.no_grad():
        out = hf(input_ids=ids[:, :prompt], use_cache=True)
        cache = out.past_key_values
        _, states = ours.prefill(ids[:, :prompt])
        b = bank.dims.kinds.index("attention")
        assert states[b].k.shape == (1, 2, prompt, 8) and states[b + 1] is None
        for k in range(prompt, prompt + steps):
            # BambaModel.forward takes position_ids = arange(seq_len) when none are given, whatever the cache holds
            # (transformers 5.23 modeling_bamba.py:970-971); generate() passes them, and so does this test
            out = hf(input_ids=ids[:, k:k + 1], past_key_values=cache, use_cache=True, position_ids=torch.tensor([[k]]))
            cache = out.past_key_values
            residual, states = ours.step(ids[:, k:k + 1], states)
            assert rel(head(residual)[:, 0], out.logits[:, -1]) <= 1e-5, k
        assert states[b].k.shape == (1, 2, prompt + steps, 8)
