"""A Quamba1 W8A8 checkpoint written by hand from Quamba's sources, with no harness code.

What QuambaLMHeadModel.save_pretrained writes (enyac-group/Quamba c474646, quamba/): torch.save of the
state dict (quamba_mixer_seq.py:444-445) plus json.dump(config.__dict__) (447-449). The values are seeded
random codes and scales, not a quantized float model: the tests use them to prove the harness uses the
file's codes and scales as they are.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from conftest import TOKENIZER

D_MODEL, N_LAYER, D_STATE, VOCAB = 24, 2, 8, 4096


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def _f16(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float16))


def handmade_state_dict(seed: int = 0, embedding: str = "Embedding", lm_head: str = "Linear") -> dict:
    g = torch.Generator().manual_seed(seed)
    E, R, N, K = 2 * D_MODEL, math.ceil(D_MODEL / 16), D_STATE, 4

    def i8(*shape):
        return torch.randint(-127, 128, shape, generator=g).to(torch.int8)

    def rand(lo, hi):
        return lo + (hi - lo) * float(torch.rand((), generator=g))

    def w8a8_weight(d_out, d_in):
        # from_fp16: int8 [out, in], zero rows padded to a multiple of 16, then .t() (qLinearLayer.py:568-574)
        pad = (16 - d_out % 16) % 16
        return torch.cat([i8(d_out, d_in), torch.zeros(pad, d_in, dtype=torch.int8)]).t()

    sd = {}
    if embedding == "W8O16Embedding":  # qEmbedding.py:74-79: int8 weight + fp16 per-row scales
        sd["backbone.embedding.weight"] = i8(VOCAB, D_MODEL)
        sd["backbone.embedding.scales"] = (torch.rand(VOCAB, generator=g) * 0.01 + 0.001).to(torch.float16)
    else:
        sd["backbone.embedding.weight"] = (torch.randn(VOCAB, D_MODEL, generator=g) * 0.5).to(torch.float16)
    for i in range(N_LAYER):
        p = f"backbone.layers.{i}."
        s_in, s_xz, s_u = _f16(rand(0.02, 0.04)), _f16(rand(0.05, 0.1)), _f32(rand(0.01, 0.03))
        s_xp, s_dt, s_h, s_H = _f16(rand(0.02, 0.05)), _f16(rand(0.01, 0.03)), _f32(rand(0.01, 0.1)), _f16(rand(0.01, 0.05))
        sd[p + "norm.weight"] = torch.ones(D_MODEL, dtype=torch.float16)       # qNorm.py:20
        sd[p + "norm.output_scale"] = s_in                                     # qNorm.py:39, a Python float
        for name, d_out, d_in, s_i, s_o in (("in_proj", 2 * E, D_MODEL, s_in, s_xz), ("x_proj", R + 2 * N, E, s_u, s_xp),
                                            ("dt_proj", E, R, s_xp, s_dt)):
            s_w = _f16(rand(0.005, 0.02))
            q = f"{p}mixer.{name}."
            sd[q + "weight"] = w8a8_weight(d_out, d_in)
            sd[q + "a"] = torch.tensor([[s_i / s_o]], dtype=torch.float32)     # qLinearLayer.py:575-579
            sd[q + "b"] = torch.tensor([[s_w]], dtype=torch.float32)           # 580-584
            sd[q + "alpha"] = (torch.tensor(s_w, dtype=torch.float32) * s_i / s_o).item()  # 587, 590-592
            if name == "in_proj":  # the conv comes between in_proj and x_proj in W8A8QMamba.__init__
                c = p + "mixer.conv1d."
                sd[c + "weight"] = i8(E, K)                                    # qConvLayer.py:28-29
                sd[c + "bias"] = i8(E)                                         # 31-32
                sd[c + "weight_scale"] = _f16(rand(0.01, 0.05))                # 75-79: Python floats
                sd[c + "bias_scale"] = _f16(rand(0.001, 0.005))
                sd[c + "input_scale"] = s_xz
                sd[c + "output_scale"] = s_u
        s = p + "mixer.selective_scan."
        t = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731 - 0-dim fp32 (qSelectiveScan.py:84-100)
        sd[s + "dt_bias"], sd[s + "dt_bias_scale"] = i8(E), t(rand(0.01, 0.03))
        sd[s + "A_log"], sd[s + "A_scale"] = i8(E, N).abs(), t(rand(0.01, 0.02))
        sd[s + "D"], sd[s + "D_scale"] = i8(E), t(rand(0.005, 0.01))
        sd[s + "u_scale"], sd[s + "dt_scale"] = t(s_u), t(s_dt)
        shared = t(s_xp)  # B_scale and C_scale: one storage (qSelectiveScan.py:131-132 on one tensor)
        sd[s + "B_scale"], sd[s + "C_scale"] = shared, shared
        sd[s + "z_scale"], sd[s + "ssm_state_scale"] = t(s_xz), t(s_h)
        sd[p + "mixer.had.x_H_scale"] = s_H                                   # qHadamard.py:18-19
        q = p + "mixer.out_proj."                                             # W8A8B16O16Linear, 771-784
        s_w = _f16(rand(0.005, 0.02))
        sd[q + "weight"] = w8a8_weight(D_MODEL, E)
        sd[q + "a"] = torch.tensor([[s_H]], dtype=torch.float32)
        sd[q + "b"] = torch.tensor([[s_w]], dtype=torch.float32)
        sd[q + "alpha"] = (torch.tensor(s_w, dtype=torch.float32) * s_H).item()
    sd["backbone.norm_f.weight"] = torch.ones(D_MODEL, dtype=torch.float16)
    if lm_head == "W8A8B16O16Linear":  # modelutils_mamba.py:658-662: QRMSNorm norm_f + W8A8B16O16Linear lm_head
        s_lm, s_w = _f16(rand(0.02, 0.05)), _f16(rand(0.005, 0.02))
        sd["backbone.norm_f.output_scale"] = s_lm
        sd["lm_head.weight"] = w8a8_weight(VOCAB, D_MODEL)
        sd["lm_head.a"] = torch.tensor([[s_lm]], dtype=torch.float32)
        sd["lm_head.b"] = torch.tensor([[s_w]], dtype=torch.float32)
        sd["lm_head.alpha"] = (torch.tensor(s_w, dtype=torch.float32) * s_lm).item()
    else:
        sd["lm_head.weight"] = (torch.randn(VOCAB, D_MODEL, generator=g) * 0.5).to(torch.float16)
    return sd


def handmade_config(embedding: str = "Embedding", lm_head: str = "Linear") -> dict:
    # MambaConfig fields + modelutils_mamba.py:863-868 (no is_hybrid, no use_cache)
    return {"d_model": D_MODEL, "d_intermediate": 0, "n_layer": N_LAYER, "vocab_size": VOCAB,
            "ssm_cfg": {"d_state": D_STATE, "layer": "W8A8QMamba"}, "attn_layer_idx": [], "attn_cfg": {},
            "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True, "pad_vocab_size_multiple": 8,
            "tie_embeddings": False, "norm_cfg": {"norm": "QRMSNorm"}, "embedding_cfg": {"layer": embedding},
            "lm_head_cfg": {"layer": lm_head}}


def write_handmade(path: Path, sd: dict | None = None, config: dict | None = None, seed: int = 0,
                   embedding: str = "Embedding", lm_head: str = "Linear") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    torch.save(handmade_state_dict(seed, embedding, lm_head) if sd is None else sd, path / "pytorch_model.bin")
    config = handmade_config(embedding, lm_head) if config is None else config
    (path / "config.json").write_text(json.dumps(config, indent=4))
    shutil.copy(TOKENIZER, path / "tokenizer.json")
    return path
