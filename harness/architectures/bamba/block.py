"""A hybrid's attention and MLP blocks (transformers 5.23 models/bamba/modeling_bamba.py), on the fp32 residual
stream, each with its input RMSNorm and residual add (one sublayer of a decoder layer: spec.HybridDims).

Attention (``BambaAttention``, :182-246, eager path :118-141):

    normed   = RMSNorm(residual)                                           norm.out
    q, k, v  = q_proj, k_proj, v_proj (normed), by heads                   (before RoPE: not a site)
    q, k     = RoPE on the first rope_dim channels of each head            attn.q, attn.k, attn.v
               (apply_rotary_pos_emb :144-179, cos/sin :90-96; the rest passes)
    p        = softmax(q k^T * head_dim^-0.5 + causal mask), fp32          attn.scores
    o        = p @ v (key/value heads repeated, repeat_kv :106-115)        attn.out
    out      = o_proj(o)                                                   o_proj.out, block.out, block.residual

MLP (``BambaMLP``, :803-817): ``down_proj(silu(gate_proj(x)) * up_proj(x))`` on the pre-FFN RMSNorm's output:
sites norm.out, mlp.gate, mlp.up, mlp.hidden, mlp.down; Nemotron-H's ungated ``down_proj(relu(up_proj(x))^2)``
(models/nemotron_h/modeling_nemotron_h.py:637-649) has no mlp.gate. Attention with rope_dim 0 has no RoPE
(Nemotron-H's).

Every op computes in fp32 and stores its output by its rule (act_dtype for the float recipes), as the Mamba
blocks do. The sites are named from emulation.capture.ATTENTION_POINTS / MLP_POINTS.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ...emulation.capture import ATTENTION_POINTS, MLP_POINTS, hook_attr
from ...emulation.modules import EmuLinear, EmuRMSNorm, OpCache
from ...emulation.state import KVState
from ...kernels.quant import dequantize, to_output
from ...spec import HookPoint, HybridDims, OutSpec

__all__ = ["EmuAttentionBlock", "EmuMLPBlock", "rope_cos_sin", "apply_rope"]


def rope_cos_sin(dims: HybridDims, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (len(positions), rope_dim) as BambaRotaryEmbedding computes them (:84-96), fp32."""
    dim = dims.rope_dim
    inv_freq = 1.0 / (dims.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    freqs = positions[:, None].to(torch.float32) * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (batch, heads, seqlen, head_dim): the first cos.shape[-1] channels rotated (rotate_half), the rest as is."""
    d = cos.shape[-1]
    rot, rest = x[..., :d], x[..., d:]
    half = torch.cat((-rot[..., d // 2:], rot[..., : d // 2]), dim=-1)
    return torch.cat((rot * cos + half * sin, rest), dim=-1)


class _Sites(nn.Module):
    def __init__(self, layer: int, sites) -> None:
        super().__init__()
        self.layer = layer
        self.hooks = nn.ModuleDict({hook_attr(p): HookPoint(p, layer) for p in sites})
        self.shared: OpCache | None = None  # a run's ops shared across modes (harness.runner.sharedops)

    def _op(self, name: str, module: nn.Module, *args):
        return module(*args) if self.shared is None else self.shared.call(self.layer, name, module, module, *args)

    def _at(self, point: str, x):
        return self.hooks[hook_attr(point)](x)


class EmuAttentionBlock(_Sites):
    """One attention sublayer (input RMSNorm, attention, residual add), with a HookPoint at every ATTENTION_POINTS
    site. ``out``: the output rule of q, k, v, the probabilities and the attention output."""

    def __init__(self, layer: int, dims: HybridDims, *, norm: EmuRMSNorm, q_proj: EmuLinear, k_proj: EmuLinear,
                 v_proj: EmuLinear, o_proj: EmuLinear, out: OutSpec, kv: tuple[OutSpec, OutSpec] | None = None,
                 mid: OutSpec | None = None) -> None:
        super().__init__(layer, ATTENTION_POINTS)
        self.dims, self.norm, self.out = dims, norm, out
        self.kv = kv or (out, out)  # the KV cache's storage of k and v (int8 / fp8 values held in fp32)
        self.mid = mid or out       # attn.out = o_proj's input
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = q_proj, k_proj, v_proj, o_proj

    def _seq_site(self, point: str, x: torch.Tensor) -> torch.Tensor:
        """A (batch, heads, seqlen, head_dim) value through its site as (batch, seqlen, heads, head_dim): the
        sequence axis second, as every site has it (the decode run stacks steps along it)."""
        return self._at(point, x.transpose(1, 2)).transpose(1, 2)

    def _heads(self, x, n: int) -> torch.Tensor:
        b, L, _ = x.shape
        return dequantize(x).reshape(b, L, n, self.dims.head_dim).transpose(1, 2)

    def forward(self, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """residual: (batch, seqlen, d_model) fp32 -> (mixer output, residual after the block), both fp32."""
        out, residual, _ = self._attend(residual, None)
        return out, residual

    def prefill(self, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, KVState]:
        """``forward``, plus the KV cache it hands to the first decode step."""
        return self._attend(residual, None)

    def step(self, residual: torch.Tensor, state: KVState) -> tuple[torch.Tensor, torch.Tensor, KVState]:
        """One token (or a few) after the cached ones: the new keys and values join the cache (transformers'
        DynamicCache.update, :222-223), the queries attend to every cached position; attn.scores is not a step site
        (its width grows with the cache)."""
        return self._attend(residual, state)

    def _attend(self, residual: torch.Tensor, cache: KVState | None) -> tuple[torch.Tensor, torch.Tensor, KVState]:
        d = self.dims
        residual = self._at("block.in", residual)
        normed = self._at("norm.out", self._op("norm", self.norm, residual))
        L, start = residual.shape[1], 0 if cache is None else cache.k.shape[2]
        cos, sin = rope_cos_sin(d, torch.arange(start, start + L))
        q = self._heads(self._op("q_proj", self.q_proj, normed), d.n_heads)
        k = self._heads(self._op("k_proj", self.k_proj, normed), d.n_kv_heads)
        q = self._seq_site("attn.q", to_output(apply_rope(q, cos, sin), self.out))
        k = self._seq_site("attn.k", dequantize(to_output(apply_rope(k, cos, sin), self.kv[0])))
        v = self._heads(self._op("v_proj", self.v_proj, normed), d.n_kv_heads)
        v = self._seq_site("attn.v", dequantize(to_output(v, self.kv[1])) if self.kv[1] != self.out else v)
        if cache is not None:
            k, v = torch.cat([cache.k, k], dim=2), torch.cat([cache.v, v], dim=2)
        rep = d.n_heads // d.n_kv_heads
        keys, values = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        logits = torch.matmul(q, keys.transpose(2, 3)) * d.head_dim ** -0.5
        future = torch.arange(start + L)[None, :] > torch.arange(start, start + L)[:, None]  # causal mask
        p = to_output(torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1), self.out)
        if cache is None:
            p = self._at("attn.scores", p)
        o = torch.matmul(p, values).transpose(1, 2).reshape(residual.shape[0], L, d.n_heads * d.head_dim)
        o = self._at("attn.out", to_output(o, self.mid))
        out = self._at("o_proj.out", dequantize(self._op("o_proj", self.o_proj, o)))
        out = self._at("block.out", out)
        return out, self._at("block.residual", residual + out), KVState(k, v)


class EmuMLPBlock(_Sites):
    """One MLP sublayer (pre-FFN RMSNorm, SiLU-gated MLP, residual add), a HookPoint at every MLP_POINTS site."""

    def __init__(self, layer: int, dims: HybridDims, *, norm: EmuRMSNorm, gate_proj: EmuLinear | None,
                 up_proj: EmuLinear, down_proj: EmuLinear, out: OutSpec, mid: OutSpec | None = None) -> None:
        super().__init__(layer, MLP_POINTS)
        self.dims, self.norm, self.out, self.mid = dims, norm, out, mid or out
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def forward(self, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        residual = self._at("block.in", residual)
        normed = self._at("norm.out", self._op("norm", self.norm, residual))
        up = dequantize(self._at("mlp.up", self._op("up_proj", self.up_proj, normed)))
        if self.gate_proj is None:  # Nemotron-H: relu(up)^2 (ReLUSquaredActivation, activations.py)
            act = torch.square(F.relu(up))
        else:
            act = F.silu(dequantize(self._at("mlp.gate", self._op("gate_proj", self.gate_proj, normed)))) * up
        hidden = self._at("mlp.hidden", to_output(act, self.mid))
        out = self._at("mlp.down", dequantize(self._op("down_proj", self.down_proj, hidden)))
        out = self._at("block.out", out)
        return out, self._at("block.residual", residual + out)

    def prefill(self, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        """``forward``; an MLP carries no state between tokens."""
        return (*self(residual), None)

    def step(self, residual: torch.Tensor, state: None) -> tuple[torch.Tensor, torch.Tensor, None]:
        return (*self(residual), None)
