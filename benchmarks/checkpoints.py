"""Seeded random Mamba-1 checkpoints of real model shapes, written in transformers' layout (safetensors).

Weights are drawn at the scales of Mamba's initialisation, so activations and
calibrated scales are of realistic size; their values mean nothing.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

__all__ = ["SHAPES", "write_random_checkpoint"]

ROOT = Path(__file__).resolve().parent.parent

# name -> (d_model, n_layer); vocab 50280 (GPT-NeoX 50277 padded to a multiple of 8), d_state 16, expand 2
SHAPES = {"mamba-130m": (768, 24), "mamba-1.4b": (2048, 48), "mamba-2.8b": (2560, 64)}


def _layer(d_model: int, gen: torch.Generator, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    d_inner, d_state, dt_rank = 2 * d_model, 16, math.ceil(d_model / 16)

    def uniform(*shape, fan_in):
        bound = 1.0 / math.sqrt(fan_in)
        return ((torch.rand(*shape, generator=gen) * 2 - 1) * bound).to(dtype)

    dt = torch.exp(torch.rand(d_inner, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    return {
        "norm.weight": (1 + 0.1 * torch.randn(d_model, generator=gen)).to(dtype),
        "mixer.in_proj.weight": uniform(2 * d_inner, d_model, fan_in=d_model),
        "mixer.conv1d.weight": uniform(d_inner, 1, 4, fan_in=4),
        "mixer.conv1d.bias": uniform(d_inner, fan_in=4),
        "mixer.x_proj.weight": uniform(dt_rank + 2 * d_state, d_inner, fan_in=d_inner),
        "mixer.dt_proj.weight": uniform(d_inner, dt_rank, fan_in=dt_rank),
        "mixer.dt_proj.bias": (dt + torch.log(-torch.expm1(-dt))).to(dtype),
        "mixer.A_log": torch.log(torch.arange(1, d_state + 1, dtype=torch.float32)).repeat(d_inner, 1),
        "mixer.D": torch.ones(d_inner),
        "mixer.out_proj.weight": uniform(d_model, d_inner, fan_in=d_inner),
    }


def write_random_checkpoint(path: Path, shape: str, dtype: torch.dtype = torch.float32, seed: int = 0,
                            vocab: int = 50280, n_layer: int | None = None) -> Path:
    """Write config.json, model.safetensors and the shipped tokenizer.json into `path`; n_layer: the first
    n_layer layers of the shape (None: all of them)."""
    from safetensors.torch import save_file

    d_model, n_layer = SHAPES[shape][0], n_layer or SHAPES[shape][1]
    gen = torch.Generator().manual_seed(seed)
    tensors = {"backbone.embeddings.weight": (torch.randn(vocab, d_model, generator=gen) * 0.02).to(dtype),
               "backbone.norm_f.weight": torch.ones(d_model, dtype=dtype)}
    for i in range(n_layer):
        tensors.update({f"backbone.layers.{i}.{k}": v for k, v in _layer(d_model, gen, dtype).items()})
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "model_type": "mamba", "architectures": ["MambaForCausalLM"], "hidden_size": d_model,
        "num_hidden_layers": n_layer, "state_size": 16, "expand": 2, "conv_kernel": 4,
        "intermediate_size": 2 * d_model, "time_step_rank": math.ceil(d_model / 16), "vocab_size": vocab,
        "layer_norm_epsilon": 1e-5, "use_bias": False, "use_conv_bias": True, "residual_in_fp32": True,
        "tie_word_embeddings": True, "dtype": str(dtype).replace("torch.", "")}, indent=2))
    shutil.copy(ROOT / "models" / "mamba-tiny" / "tokenizer.json", path / "tokenizer.json")
    return path
