"""A seeded random Mamba-2 checkpoint of mamba2-130m's shape, written in transformers' layout (safetensors).

mamba2-130m (state-spaces/mamba2-130m): d_model 768, 24 layers, expand 2, headdim 64 (24 heads), ngroups 1,
d_state 128, d_conv 4, chunk 256, tied embeddings. The weights are drawn at the scales of Mamba-2's initialisation
(mamba_ssm's Mamba2: dt in [1e-3, 0.1] through an inverse softplus, A in [1, 16], D = 1), so activations and
calibrated scales are of realistic size; their values mean nothing. The vocabulary is the shipped tokenizer's
(50280, as benchmarks/checkpoints.py).
"""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import torch

__all__ = ["write_random_mamba2"]

ROOT = Path(__file__).resolve().parent.parent


def _layer(d: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    d_model, d_inner, nheads, n = d["d_model"], 2 * d["d_model"], d["nheads"], d["d_state"]
    conv_dim = d_inner + 2 * d["ngroups"] * n

    def uniform(*shape, fan_in):
        return (torch.rand(*shape, generator=gen) * 2 - 1) / math.sqrt(fan_in)

    dt = torch.exp(torch.rand(nheads, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    return {
        "norm.weight": 1 + 0.1 * torch.randn(d_model, generator=gen),
        "mixer.in_proj.weight": uniform(2 * d_inner + 2 * d["ngroups"] * n + nheads, d_model, fan_in=d_model),
        "mixer.conv1d.weight": uniform(conv_dim, 1, 4, fan_in=4),
        "mixer.conv1d.bias": uniform(conv_dim, fan_in=4),
        "mixer.dt_bias": dt + torch.log(-torch.expm1(-dt)),
        "mixer.A_log": torch.log(1 + 15 * torch.rand(nheads, generator=gen)),
        "mixer.D": torch.ones(nheads),
        "mixer.norm.weight": 1 + 0.1 * torch.randn(d_inner, generator=gen),
        "mixer.out_proj.weight": uniform(d_model, d_inner, fan_in=d_inner),
    }


def write_random_mamba2(path: Path, n_layer: int = 24, seed: int = 0, vocab: int = 50280) -> Path:
    """config.json (transformers' Mamba2Config), model.safetensors and the shipped tokenizer.json in `path`."""
    from safetensors.torch import save_file
    from transformers import Mamba2Config

    d = {"d_model": 768, "nheads": 24, "d_state": 128, "ngroups": 1}
    gen = torch.Generator().manual_seed(seed)
    tensors = {"backbone.embeddings.weight": torch.randn(vocab, d["d_model"], generator=gen) * 0.02,
               "backbone.norm_f.weight": torch.ones(d["d_model"])}
    for i in range(n_layer):
        tensors.update({f"backbone.layers.{i}.{k}": v.contiguous() for k, v in _layer(d, gen).items()})
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    Mamba2Config(vocab_size=vocab, hidden_size=d["d_model"], num_hidden_layers=n_layer, state_size=d["d_state"],
                 expand=2, num_heads=d["nheads"], head_dim=64, n_groups=d["ngroups"], chunk_size=256, conv_kernel=4,
                 tie_word_embeddings=True, layer_norm_epsilon=1e-5, architectures=["Mamba2ForCausalLM"]
                 ).save_pretrained(path)
    shutil.copy(ROOT / "models" / "mamba-tiny" / "tokenizer.json", path / "tokenizer.json")
    return path
