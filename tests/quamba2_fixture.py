"""A Quamba2 W8A8 checkpoint written by hand from Quamba's sources, with no harness code.

What ``QuambaLMHeadModel.save_pretrained`` writes for a ``W8A8QMamba2`` model (enyac-group/Quamba c474646,
quamba/): torch.save of the state dict (quamba_mixer_seq.py:444-445) plus json.dump(config.__dict__)
(447-449; the fields set by modelutils_mamba.py:863-872). Each module's entries in the order its
``state_dict`` gives them: buffers first, then what its ``store_hook`` adds. Seeded random codes and scales,
not a quantized model: the tests use them to show the reader takes the file's codes and scales as they are.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from conftest import TOKENIZER

D_MODEL, N_LAYER, D_STATE, NGROUPS, HEADDIM, CHUNK, VOCAB = 32, 2, 8, 2, 8, 8, 4096
D_INNER = 2 * D_MODEL
NHEADS = D_INNER // HEADDIM


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def _pad16(n: int) -> int:
    return -(-n // 16) * 16


def handmade_q2_state_dict(seed: int = 0, d_model: int = D_MODEL, n_layer: int = N_LAYER, d_state: int = D_STATE,
                           ngroups: int = NGROUPS, headdim: int = HEADDIM, vocab: int = VOCAB) -> dict:
    g = torch.Generator().manual_seed(seed)
    E = 2 * d_model
    H, K = E // headdim, 4
    n_in = 2 * E + 2 * ngroups * d_state + H            # [z, x, B, C, dt] (qMamba2.py:1134)
    conv_dim = E + 2 * ngroups * d_state

    def i8(*shape):
        return torch.randint(-127, 128, shape, generator=g).to(torch.int8)

    def pos(*shape, lo=0.01, hi=0.05):
        return (lo + (hi - lo) * torch.rand(shape, generator=g)).to(torch.float32)

    def rand(lo, hi):
        return _f32(lo + (hi - lo) * float(torch.rand((), generator=g)))

    def ranges(rows: int, end: int):
        # cumulative ends of 4 non-empty groups per row (get_group_params, qMamba2.py:57-59)
        out = []
        for _ in range(rows):
            cuts = sorted(torch.randperm(end - 1, generator=g)[:3].add(1).tolist()) if end > 4 else [1, 2, 3]
            out.append(cuts + [end])
        return torch.tensor(out, dtype=torch.int32)

    sd = {"backbone.embedding.weight": (torch.randn(vocab, d_model, generator=g) * 0.5).to(torch.float16)}
    for i in range(n_layer):
        p, m = f"backbone.layers.{i}.", f"backbone.layers.{i}.mixer."
        s_in = rand(0.02, 0.04)
        # W8A8B8O8LinearParallel (qLinearLayer.py:638-713): int8 [n_in + pad, d_model] rows, zero padding,
        # .t() -> [d_model, n_in + pad] not contiguous; a = [[input_scale]]; b = [per-column s_w/s_out + 0 pad]
        codes = torch.cat([i8(n_in, d_model), torch.zeros(_pad16(n_in) - n_in, d_model, dtype=torch.int8)])
        sd[m + "in_proj.weight"] = codes.t()
        sd[m + "in_proj.a"] = torch.tensor([[s_in]], dtype=torch.float32)
        sd[m + "in_proj.b"] = torch.cat([pos(n_in, lo=0.05, hi=0.5), torch.zeros(_pad16(n_in) - n_in)])[None]
        # Quamb2Conv1D (qConvLayer.py:129-287): buffers weight, bias, ranges, out scales; then the hook's floats
        c = m + "conv1d."
        head_range, dim_range = ranges(ngroups, H // ngroups), ranges(ngroups * 4, headdim).reshape(ngroups, 4, 4)
        x_out = pos(ngroups, 4, 4)
        B_out, C_out = pos(ngroups), pos(ngroups)
        sd[c + "weight"], sd[c + "bias"] = i8(conv_dim, K), i8(conv_dim)
        sd[c + "x_head_group_range"], sd[c + "x_dim_group_range"] = head_range, dim_range
        sd[c + "x_out_scales"], sd[c + "B_out_scales"], sd[c + "C_out_scales"] = x_out, B_out, C_out
        x_s, B_s, C_s = rand(0.02, 0.05), rand(0.02, 0.05), rand(0.02, 0.05)
        for name, v in (("x_scale", x_s), ("B_scale", B_s), ("C_scale", C_s), ("wx_scale", rand(0.005, 0.02)),
                        ("wB_scale", rand(0.005, 0.02)), ("wC_scale", rand(0.005, 0.02)), ("bx_scale", rand(0.001, 0.01)),
                        ("bB_scale", rand(0.001, 0.01)), ("bC_scale", rand(0.001, 0.01))):
            sd[c + name] = v
        # Quamba2ChunkScan (qChunkScan.py:37-80, 105-141): dt_bias fp16; A_log, D int8 + 0-dim fp32 scales;
        # dt_scale 0-dim; ssm_state_scale [g, 4, 4, N]; x_scales, ranges, B_scale, C_scale: conv1d's tensors
        q = m + "qchunk_scan."
        sd[q + "dt_bias"] = (torch.randn(H, generator=g) * 0.5).to(torch.float16)
        sd[q + "A_log"], sd[q + "A_log_scale"] = i8(H).abs(), torch.tensor(rand(0.01, 0.03))
        sd[q + "D"], sd[q + "D_scale"] = i8(H), torch.tensor(rand(0.005, 0.01))
        sd[q + "dt_scale"] = torch.tensor(rand(0.01, 0.03))
        sd[q + "ssm_state_scale"] = pos(ngroups, 4, 4, d_state)
        sd[q + "x_scales"], sd[q + "x_head_group_range"], sd[q + "x_dim_group_range"] = x_out, head_range, dim_range
        sd[q + "B_scale"], sd[q + "C_scale"] = B_out, C_out
        # QRMSNormGated (qNorm.py:102-137): fp16 weight; z_scale float; output_scale None (fp16 output)
        sd[m + "norm.weight"] = (1 + 0.1 * torch.randn(E, generator=g)).to(torch.float16)
        sd[m + "norm.z_scale"], sd[m + "norm.output_scale"] = rand(0.02, 0.06), None
        s_H = rand(0.01, 0.05)
        sd[m + "had.x_H_scale"] = s_H                                           # qHadamard.py:18-19
        s_w = rand(0.005, 0.02)                                                 # W8A8B16O16Linear, :745-784
        out_codes = torch.cat([i8(d_model, E), torch.zeros(_pad16(d_model) - d_model, E, dtype=torch.int8)])
        sd[m + "out_proj.weight"] = out_codes.t()
        sd[m + "out_proj.a"] = torch.tensor([[s_H]], dtype=torch.float32)
        sd[m + "out_proj.b"] = torch.tensor([[s_w]], dtype=torch.float32)
        sd[m + "out_proj.alpha"] = (torch.tensor(s_w, dtype=torch.float32) * s_H).item()
        sd[p + "norm.weight"] = torch.ones(d_model, dtype=torch.float16)        # QRMSNorm, qNorm.py:20, 38-39
        sd[p + "norm.output_scale"] = s_in
    sd["backbone.norm_f.weight"] = torch.ones(d_model, dtype=torch.float16)
    sd["lm_head.weight"] = (torch.randn(vocab, d_model, generator=g) * 0.5).to(torch.float16)
    return sd


def handmade_q2_config(d_model: int = D_MODEL, n_layer: int = N_LAYER, d_state: int = D_STATE, ngroups: int = NGROUPS,
                       headdim: int = HEADDIM, vocab: int = VOCAB, chunk: int = CHUNK) -> dict:
    # MambaConfig fields + modelutils_mamba.py:863-872 (no is_hybrid for W8A8, no use_cache)
    return {"d_model": d_model, "d_intermediate": 0, "n_layer": n_layer, "vocab_size": vocab,
            "ssm_cfg": {"d_state": d_state, "headdim": headdim, "ngroups": ngroups, "chunk_size": chunk,
                        "layer": "W8A8QMamba2"},
            "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True,
            "pad_vocab_size_multiple": 8, "tie_embeddings": False, "norm_cfg": {"norm": "QRMSNorm"},
            "embedding_cfg": {"layer": "Embedding"}, "lm_head_cfg": {"layer": "Linear"}}


def write_handmade_q2(path: Path, sd: dict | None = None, config: dict | None = None, seed: int = 0) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    torch.save(handmade_q2_state_dict(seed) if sd is None else sd, path / "pytorch_model.bin")
    (path / "config.json").write_text(json.dumps(handmade_q2_config() if config is None else config, indent=4))
    shutil.copy(TOKENIZER, path / "tokenizer.json")
    return path
