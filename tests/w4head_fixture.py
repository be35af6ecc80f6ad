"""A W4 checkpoint's W4O16Embedding and W4 lm_head written by hand from Quamba's source (enyac-group/Quamba c474646),
with no harness code: ``W4O16Embedding.from_fp16`` (quamba/qEmbedding.py:26-47) as written there, run on CPU, and
the lm_head's Marlin packing (tests/marlin_fixture.py, from quamba/marlin_utils.py), its out-features (the vocab)
padded to 256 (W4A16B16O16Linear, qLinearLayer.py:24-26) or 64 (W4A8B16O16Linear, :150-152)."""
from __future__ import annotations

import numpy as np
import torch

from marlin_fixture import pack_given

HEADS = {"W4A16": "W4A16B16O16Linear", "W4A8": "W4A8B16O16Linear"}  # modelutils_mamba.py:650-657
VOCAB = 4104  # a multiple of 8 (pad_vocab_size_multiple) but of neither 64 nor 256: the head's pad_out is not 0


def quamba_w4_embedding(embed_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W4O16Embedding.from_fp16 (qEmbedding.py:29-46) of an fp16 table: (weight int32 [V, D/8], scales fp16 [V])."""
    vocab_size = embed_w.shape[0]
    max_val, zero_point, pack_factor = 2 ** 4, 2 ** 3, 8
    interleave = np.array([0, 2, 4, 6, 1, 3, 5, 7])
    scales = embed_w.amax(dim=-1, keepdim=True) / (max_val / 2)
    embed_qw = torch.round((embed_w / scales) + zero_point).clamp(0, max_val - 1)
    embed_qw = embed_qw.to(torch.int32).numpy().astype(np.uint32)
    embed_qw = embed_qw.reshape(vocab_size, -1, 8)
    embed_qw = embed_qw[:, :, interleave].reshape(vocab_size, -1)
    packed = np.zeros((embed_qw.shape[0], embed_qw.shape[1] // pack_factor), dtype=np.int32)
    for i in range(pack_factor):
        packed |= (embed_qw[:, i::pack_factor] & 0xF) << 4 * i  # int32 |= uint32: wraps as upstream's
    return torch.from_numpy(packed).to(torch.int32), scales.flatten().to(torch.float16)


def add_w4_head(sd: dict, cfg: dict, recipe: str, seed: int = 1, input_scale: float = 0.03, head: bool = True) -> dict:
    """Replace sd's fp16 embedding and lm_head (in place) by a W4O16Embedding of the same fp16 table and a seeded
    W4 lm_head (head False: the fp16 lm_head kept); cfg's embedding_cfg / lm_head_cfg likewise
    (modelutils_mamba.py:865-866). Returns the truth: the fp16 table, the head's codes, group scales and (W4A8)
    channel scales."""
    g = torch.Generator().manual_seed(seed)
    table = sd["backbone.embedding.weight"]
    vocab, d_model = table.shape
    weight, scales = quamba_w4_embedding(table)
    sd["backbone.embedding.weight"], sd["backbone.embedding.scales"] = weight, scales
    cfg["embedding_cfg"] = {"layer": "W4O16Embedding"}
    if not head:
        return {"table": table}
    del sd["lm_head.weight"]
    codes = torch.randint(0, 16, (vocab, d_model), generator=g).to(torch.uint8)
    # W4A8's s_group is s / s_channel, around 127 / 7 (marlin_utils.py:184-192): its int8 weights span [-128, 127]
    size = (2.0, 16.0) if recipe == "W4A8" else (0.01, 0.001)
    groups = (torch.rand(vocab, d_model // 128, generator=g) * size[0] + size[1]).to(torch.float16)
    channel = (torch.rand(vocab, generator=g) * 0.01 + 1e-3).to(torch.float32) if recipe == "W4A8" else None
    sd.update({f"lm_head.{k}": v for k, v in pack_given(codes, groups, channel).items()})
    if recipe == "W4A8":  # QRMSNorm.from_fp16(output_scale=lm_head:input.item()) and the head's input_scale tensor
        s = torch.tensor(input_scale, dtype=torch.float32)
        sd["backbone.norm_f.output_scale"], sd["lm_head.input_scale"] = s.item(), s
    cfg["lm_head_cfg"] = {"layer": HEADS[recipe]}
    return {"table": table, "codes": codes, "groups": groups, "channel": channel}
