"""Marlin packing written out from Quamba's source (enyac-group/Quamba c474646 quamba/marlin_utils.py), with no
harness code, and a W4A8/W4A16 Quamba2 checkpoint built with it."""
from __future__ import annotations

import numpy as np
import torch

from quamba2_fixture import handmade_q2_state_dict


def quamba_perm(w4a16: bool) -> torch.Tensor:
    # get_w4a16_weight_perms (:371-391) / get_w4a8_weight_perm(4, "per-group") (:75-105)
    perm_list = []
    for i in range(32):
        perm1 = []
        col = i // 4
        for block in [0, 1]:
            rows = [2 * (i % 4), 2 * (i % 4) + 1, 2 * (i % 4 + 4), 2 * (i % 4 + 4) + 1] if w4a16 else \
                [4 * (i % 4), 4 * (i % 4) + 1, 4 * (i % 4) + 2, 4 * (i % 4) + 3]
            for row in rows:
                perm1.append(16 * row + col + 8 * block)
        for j in range(4):
            perm_list.extend([p + 256 * j for p in perm1])
    perm = np.array(perm_list)
    interleave = np.array([0, 2, 4, 6, 1, 3, 5, 7])
    return torch.from_numpy(perm.reshape((-1, len(interleave)))[:, interleave].ravel())


def quamba_pack(q_w: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    # permute_weights (:33-45) then the packing loop (:57-68, :291-298)
    size_k, size_n = q_w.shape
    q_w = q_w.reshape((size_k // 16, 16, size_n // 16, 16)).permute((0, 2, 1, 3)).reshape((size_k // 16, size_n * 16))
    q_w = q_w.reshape((-1, perm.numel()))[:, perm].reshape(q_w.shape)
    q_w = q_w.numpy().astype(np.uint32)
    q_packed = np.zeros((q_w.shape[0], q_w.shape[1] // 8), dtype=np.uint32)
    for i in range(8):
        q_packed |= q_w[:, i::8] << 4 * i
    return torch.from_numpy(q_packed.astype(np.int32))


def scale_perms():
    # get_scale_perms (:109-117)
    scale_perm = []
    for i in range(8):
        scale_perm.extend([i + 8 * j for j in range(8)])
    scale_perm_single = []
    for i in range(4):
        scale_perm_single.extend([2 * i + j for j in [0, 1, 8, 9, 16, 17, 24, 25]])
    return scale_perm, scale_perm_single


def _pad(n: int, m: int) -> int:
    return -(-n // m) * m


def pack_given(codes: torch.Tensor, groups: torch.Tensor, channel: torch.Tensor | None) -> dict:
    """codes [out, in] 0..15, group scales [out, in / 128] fp16 (W4A8: s / s_channel), channel scales [out] fp32
    (W4A8, the output scale already divided in for in_proj) or None (W4A16) -> the module's state-dict entries by
    suffix: W4A8B8O8LinearParallel / W4A8B16O16Linear (workspace, weight, s_channel, s_group; qLinearLayer.py:
    139-215, 420-505) or W4A16B16O16Linear (workspace, weight, scale; :13-75). Out-features padded to 64 / 256:
    zero codes, zero group scales, s_channel 1e-6 (w4a8_quantize, marlin_utils.py:258-262)."""
    w4a8 = channel is not None
    out, k = codes.shape
    n = _pad(out, 64 if w4a8 else 256)
    q = torch.zeros(k, n, dtype=torch.int32)
    q[:, :out] = codes.t().to(torch.int32)
    g = torch.zeros(k // 128, n, dtype=torch.float16)
    g[:, :out] = groups.t()
    perm, single = scale_perms()
    entries = {"workspace": torch.zeros((n // 64) * 16, dtype=torch.int32), "weight": quamba_pack(q, quamba_perm(not w4a8))}
    sg = g.reshape((-1, len(perm)))[:, perm].reshape((-1, n)).contiguous()
    if not w4a8:
        return {**entries, "scale": sg}
    ch = torch.full((1, n), 1e-6, dtype=torch.float32)
    ch[0, :out] = channel
    return {**entries, "s_channel": ch.reshape((-1, len(single)))[:, single].reshape((-1, n)).contiguous(), "s_group": sg}


def pack_linear(codes: torch.Tensor, w4a8: bool, gen: torch.Generator, size: float = 1.0) -> tuple[dict, dict]:
    """codes [out, in] 0..15 -> (the module's state-dict entries by suffix, the true scales), seeded scales."""
    out, k = codes.shape
    groups = ((torch.rand(out, k // 128, generator=gen) + 0.5) * size).to(torch.float16)
    if not w4a8:
        return pack_given(codes, groups, None), {"groups": groups}
    channel = (torch.rand(out, generator=gen) * 0.01 + 1e-3).to(torch.float32)
    return {**pack_given(codes, groups, channel), "input_scale": torch.tensor(0.05)}, \
        {"groups": groups, "channel": channel}


def w4_state_dict(recipes: list[list[str]], seed: int = 0, hybrid: bool = False, vocab: int = 64,
                  size: float = 1.0) -> tuple[dict, dict]:
    """A W4 checkpoint's state dict (d_model 256, headdim 64, d_state 16, ngroups 2: K >= 256 for Marlin's groups)
    and the codes and scales packed in it: {(layer, recipe, linear): (codes, scales)}."""
    g = torch.Generator().manual_seed(seed)
    d_model, d_state, ngroups, headdim = 256, 16, 2, 64
    d_inner, nheads = 2 * d_model, 2 * d_model // headdim
    n_in = 2 * d_inner + 2 * ngroups * d_state + nheads
    base = handmade_q2_state_dict(seed, d_model=d_model, n_layer=len(recipes), d_state=d_state, ngroups=ngroups,
                                  headdim=headdim, vocab=vocab)
    sd = {k: v for k, v in base.items() if not k.startswith("backbone.layers.")}
    truth = {}
    for i, layer in enumerate(recipes):
        p = f"backbone.layers.{i}."
        for recipe in layer:
            m, nrm = (f"{p}mixers.{recipe}.", f"{p}norms.{recipe}.") if hybrid else (f"{p}mixer.", f"{p}norm.")
            sd[nrm + "weight"] = torch.ones(d_model, dtype=torch.float16)
            if recipe == "W4A8":  # W8A8QMamba2's activation path (qMamba2.py:800-824)
                sd[nrm + "output_scale"] = base[p + "norm.output_scale"]
                for k, v in base.items():
                    if k.startswith(p + "mixer.") and not k[len(p + "mixer."):].startswith(("in_proj.", "out_proj.")):
                        sd[m + k[len(p + "mixer."):]] = v
            else:  # the fp16 model's own tensors (qMamba2.py:447-485)
                conv_dim = d_inner + 2 * ngroups * d_state
                sd[m + "conv1d.weight"] = torch.randn(conv_dim, 1, 4, generator=g).to(torch.float16)
                sd[m + "conv1d.bias"] = torch.randn(conv_dim, generator=g).to(torch.float16)
                sd[m + "dt_bias"] = torch.randn(nheads, generator=g).to(torch.float16)
                sd[m + "A_log"] = torch.rand(nheads, generator=g).to(torch.float16)
                sd[m + "D"] = torch.ones(nheads)
                sd[m + "norm.weight"] = torch.ones(d_inner, dtype=torch.float16)
            for name, out, k in (("in_proj", n_in, d_model), ("out_proj", d_model, d_inner)):
                codes = torch.randint(0, 16, (out, k), generator=g).to(torch.uint8)
                entries, scales = pack_linear(codes, recipe == "W4A8", g, size)
                sd.update({f"{m}{name}.{key}": v for key, v in entries.items()})
                truth[(i, recipe, name)] = (codes, scales)
    return sd, truth


def w4_config(recipes: list[list[str]], hybrid: bool = False, vocab: int = 64) -> dict:
    """config.json (modelutils_mamba.py:863-900): one recipe for every layer, or hybrid per-layer tables."""
    cls = {"W4A8": "W4A8QMamba2", "W4A16": "W4A16QMamba2"}
    norm = {"W4A8": "QRMSNorm", "W4A16": "RMSNorm"}
    ssm = {"d_state": 16, "headdim": 64, "ngroups": 2, "chunk_size": 8}
    cfg = {"d_model": 256, "d_intermediate": 0, "n_layer": len(recipes), "vocab_size": vocab, "attn_layer_idx": [],
           "attn_cfg": {}, "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True,
           "pad_vocab_size_multiple": 8, "tie_embeddings": False, "embedding_cfg": {"layer": "Embedding"},
           "lm_head_cfg": {"layer": "Linear"}}
    if hybrid:
        cfg.update(ssm_cfg={**ssm, "layer": [{r: cls[r] for r in layer} for layer in recipes]},
                   norm_cfg={"norm": [{r: norm[r] for r in layer} for layer in recipes]}, is_hybrid=True)
    else:
        cfg.update(ssm_cfg={**ssm, "layer": cls[recipes[0][0]]}, norm_cfg={"norm": norm[recipes[0][0]]})
    return cfg
