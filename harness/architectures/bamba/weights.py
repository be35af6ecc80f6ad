"""A hybrid block's weights as a float recipe needs them: the Mamba-2 blocks' are Mamba-2's own preparation
(asked through the registry); the attention and MLP blocks' are rounded to the weight dtype, and with rotate=yes
the residual stream is rotated with Had_D as for the Mamba blocks (architectures.transforms): the block's RMSNorm
weight folds into the columns of the linears that read the normed stream (q, k, v; gate, up), which then take
Had_D^T, and the linears that write the stream (o_proj, down_proj) become Had_D W. Attention and the MLP see the
same values as unrotated (Had_D is orthogonal and RMSNorm only needs the norm of the stream)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernels.hadamard import hadamard_transform
from ...kernels.quant import round_to_dtype
from ...kernels.rounding import round_half_even

__all__ = ["AttentionParams", "MLPParams", "attention_layer", "mlp_layer", "per_channel_int8"]


@dataclass
class AttentionParams:
    """q_proj (n_heads*head_dim, d_model), k_proj and v_proj (n_kv_heads*head_dim, d_model), o_proj (d_model,
    n_heads*head_dim); norm_weight (d_model,) or None (folded); fp32 tensors holding values of their dtype."""

    norm_weight: torch.Tensor | None
    q_proj: torch.Tensor
    k_proj: torch.Tensor
    v_proj: torch.Tensor
    o_proj: torch.Tensor


@dataclass
class MLPParams:
    """gate_proj and up_proj (d_ff, d_model), down_proj (d_model, d_ff); norm_weight (d_model,) or None (folded);
    gate_proj None for an ungated MLP (Nemotron-H's ReLU^2)."""

    norm_weight: torch.Tensor | None
    up_proj: torch.Tensor
    down_proj: torch.Tensor
    gate_proj: torch.Tensor | None = None


def _prepare(raw: dict[str, torch.Tensor | None], reads: tuple[str, ...], writes: str, rotate: bool,
             dtype: torch.dtype) -> dict[str, torch.Tensor | None]:
    rnd = lambda t: round_to_dtype(t, dtype)  # noqa: E731
    if not rotate:
        return {"norm_weight": rnd(raw["norm_weight"]), writes: rnd(raw[writes]), **{n: rnd(raw[n]) for n in reads}}
    norm = raw["norm_weight"].to(torch.float64)
    out = {n: rnd(hadamard_transform(rnd(raw[n].to(torch.float64) * norm))) for n in reads}  # (W diag(w)) Had_D^T
    return {"norm_weight": None, writes: rnd(hadamard_transform(rnd(raw[writes]).t()).t()), **out}  # Had_D W


def attention_layer(raw: dict[str, torch.Tensor | None], rotate: bool, dtype: torch.dtype) -> AttentionParams:
    return AttentionParams(**_prepare(raw, ("q_proj", "k_proj", "v_proj"), "o_proj", rotate, dtype))


def mlp_layer(raw: dict[str, torch.Tensor | None], rotate: bool, dtype: torch.dtype) -> MLPParams:
    return MLPParams(**_prepare(raw, tuple(n for n in ("gate_proj", "up_proj") if n in raw), "down_proj", rotate,
                                dtype))


def per_channel_int8(w: torch.Tensor) -> torch.Tensor:
    """A linear weight (out, in) on its per-output-channel int8 grid, as fp32 values: s_c = max(|w_c|, 1e-5) / 127
    in fp32, codes RNE(w / s_c) (within [-127, 127]), values codes * s_c. The W8A8 GEMM with per-channel weight
    scales multiplies these values by the int8 input's (exactly, in fp32, for the sizes tested)."""
    w = w.to(torch.float32)
    s = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-5) / 127
    return round_half_even(w / s) * s
