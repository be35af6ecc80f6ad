"""Small seeded Mamba-2 models in both checkpoint layouts, written with transformers' own save."""
from __future__ import annotations

import json
from pathlib import Path

import torch


def make_mamba2(out: Path, *, ngroups: int = 2, layers: int = 2, chunk: int = 8, tie: bool = True,
                d_model: int = 32, headdim: int = 8, d_state: int = 8, vocab: int = 64, seed: int = 0):
    """A transformers Mamba2ForCausalLM with seeded weights (A_log, D, dt_bias and the norms randomised too),
    saved to `out`; returns the model (fp32, eval)."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    torch.manual_seed(seed)
    cfg = Mamba2Config(vocab_size=vocab, hidden_size=d_model, num_hidden_layers=layers, state_size=d_state,
                       expand=2, num_heads=2 * d_model // headdim, head_dim=headdim, n_groups=ngroups,
                       chunk_size=chunk, conv_kernel=4, tie_word_embeddings=tie, layer_norm_epsilon=1e-5)
    model = Mamba2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand_like(p) * 2.0 - 0.5)
            elif name.endswith(".D") or name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p))
            elif name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.2)
    model.save_pretrained(out)
    return model


def to_mamba_ssm_layout(src: Path, dst: Path) -> None:
    """The same weights in mamba_ssm's layout: MambaConfig keys with ssm_cfg {layer: Mamba2}, backbone.embedding.*,
    pytorch_model.bin."""
    from safetensors.torch import load_file

    cfg = json.loads((src / "config.json").read_text())
    sd = load_file(src / "model.safetensors")
    sd = {k.replace("backbone.embeddings.", "backbone.embedding."): v for k, v in sd.items()}
    if cfg["tie_word_embeddings"]:
        sd["lm_head.weight"] = sd["backbone.embedding.weight"]
    dst.mkdir(parents=True, exist_ok=True)
    torch.save(sd, dst / "pytorch_model.bin")
    ssm = {"layer": "Mamba2", "d_state": cfg["state_size"], "d_conv": cfg["conv_kernel"], "expand": cfg["expand"],
           "headdim": cfg["head_dim"], "ngroups": cfg["n_groups"], "chunk_size": cfg["chunk_size"]}
    (dst / "config.json").write_text(json.dumps({
        "d_model": cfg["hidden_size"], "d_intermediate": 0, "n_layer": cfg["num_hidden_layers"],
        "vocab_size": cfg["vocab_size"], "ssm_cfg": ssm, "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True,
        "residual_in_fp32": True, "fused_add_norm": True, "pad_vocab_size_multiple": 1,
        "tie_embeddings": cfg["tie_word_embeddings"], "norm_epsilon": cfg["layer_norm_epsilon"]}))
