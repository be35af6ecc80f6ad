"""Bamba / Granite 4.0-H hybrid checkpoints (transformers' ``BambaForCausalLM``, ``model_type: bamba``).

Decoder layer i (transformers 5.23 models/bamba/modeling_bamba.py:840-899, ``BambaDecoderLayer``) is
``h + mixer(input_layernorm(h))`` then ``h + feed_forward(pre_ff_layernorm(h))``; the mixer is a Mamba-2 block
(``mamba.*``, ``BambaMixer`` :583-800, Mamba2Mixer's torch path) or, at ``attn_layer_indices``, attention
(``self_attn.{q,k,v,o}_proj``, ``BambaAttention`` :182-246); the MLP is ``feed_forward.{gate,up,down}_proj``
(``BambaMLP`` :803-817). The harness's blocks are the sublayers (spec.HybridDims): block 2i the mixer, block 2i+1
the MLP. Config keys (configuration_bamba.py:49-106): ``hidden_size``, ``num_hidden_layers``,
``intermediate_size`` (the MLP), ``num_attention_heads``, ``num_key_value_heads``, ``rms_norm_eps`` (every RMSNorm
and the gated norm, :614-616), ``mamba_{n_heads,d_head,n_groups,d_state,d_conv,expand,chunk_size}``, and
``rope_parameters`` (``rope_theta``; ``partial_rotary_factor`` 0.5, which the config forces, :93). What the
harness does not emulate (biases, another activation or RoPE type, a time-step limit) is refused by name.
"""
from __future__ import annotations

import math

from ...spec import HybridDims
from ..config_values import REQUIRED, config_int, config_table

__all__ = ["BAMBA_MODEL_TYPES", "BAMBA_CLASSES", "SSM", "ATTENTION", "MLP", "is_bamba_config", "bamba_dims",
           "bamba_block_keys", "open_bamba", "check_hybrid_dims", "check_hybrid_shapes"]

BAMBA_MODEL_TYPES = ("bamba",)
BAMBA_CLASSES = ("BambaForCausalLM", "BambaModel")
SSM, ATTENTION, MLP = "ssm", "attention", "mlp"  # the kinds of a hybrid's blocks (HybridDims.kinds)

# canonical name -> key suffix under model.layers.{decoder layer}., per block kind
_TENSORS: dict[str, dict[str, str]] = {
    SSM: {"norm_weight": "input_layernorm.weight", "in_proj": "mamba.in_proj.weight",
          "conv_weight": "mamba.conv1d.weight", "conv_bias": "mamba.conv1d.bias", "dt_bias": "mamba.dt_bias",
          "A_log": "mamba.A_log", "D": "mamba.D", "gnorm_weight": "mamba.norm.weight",
          "out_proj": "mamba.out_proj.weight"},
    ATTENTION: {"norm_weight": "input_layernorm.weight", "q_proj": "self_attn.q_proj.weight",
                "k_proj": "self_attn.k_proj.weight", "v_proj": "self_attn.v_proj.weight",
                "o_proj": "self_attn.o_proj.weight"},
    MLP: {"norm_weight": "pre_ff_layernorm.weight", "gate_proj": "feed_forward.gate_proj.weight",
          "up_proj": "feed_forward.up_proj.weight", "down_proj": "feed_forward.down_proj.weight"},
}
_OPTIONAL = {"conv_bias"}
_LAYOUT = "the Bamba layout (model_type bamba: hidden_size, num_hidden_layers, ...)"


def is_bamba_config(cfg: dict) -> bool:
    archs = cfg.get("architectures")
    return cfg.get("model_type") in BAMBA_MODEL_TYPES or (isinstance(archs, list) and any(a in BAMBA_CLASSES for a in archs))


def _number(v) -> float:
    """A config number; transformers 5.23 writes a non-finite float as {"__float__": "Infinity"}."""
    return float(v["__float__"]) if isinstance(v, dict) and "__float__" in v else float(v)


def _refusals(cfg: dict) -> list[str]:
    limit = cfg.get("time_step_limit")
    bad = [k for k in ("attention_bias", "mlp_bias", "mamba_proj_bias") if cfg.get(k)]
    if cfg.get("hidden_act", "silu") != "silu":
        bad.append(f"hidden_act={cfg['hidden_act']!r} (SiLU only)")
    if limit is not None and not (len(limit) == 2 and _number(limit[0]) == 0.0 and math.isinf(_number(limit[1]))):
        bad.append(f"time_step_limit={limit} (only (0, inf))")
    rope = config_table(cfg, "rope_parameters")
    if rope.get("rope_type", "default") != "default":
        bad.append(f"rope_parameters.rope_type={rope['rope_type']!r} (default RoPE only)")
    if cfg.get("num_experts", 1) not in (None, 1):
        bad.append("num_experts (mixture of experts)")
    return bad


def bamba_dims(cfg: dict, vocab: int) -> HybridDims:
    """The dims of a Bamba config.json; ValueError naming the key for a value the harness cannot use."""
    bad = _refusals(cfg)
    if bad:
        raise ValueError(f"{', '.join(bad)} is not supported")
    get = lambda key, default: config_int(cfg, key, default, layout=_LAYOUT)  # noqa: E731
    d_model, layers = get("hidden_size", REQUIRED), get("num_hidden_layers", REQUIRED)
    attn = cfg.get("attn_layer_indices") or []
    if not isinstance(attn, list) or not all(type(i) is int and 0 <= i < layers for i in attn):
        raise ValueError(f"'attn_layer_indices' must be a list of decoder layer indices in 0..{layers - 1}, "
                         f"got {attn!r}")
    n_heads, nheads = get("num_attention_heads", REQUIRED), get("mamba_n_heads", 128)
    d_inner = get("mamba_expand", 2) * d_model
    head_dim = config_int(cfg, "head_dim", 0) or (d_model // n_heads if n_heads > 0 else 0)
    rope = config_table(cfg, "rope_parameters")
    d_head = cfg.get("mamba_d_head", "auto")
    eps = float(cfg.get("rms_norm_eps", 1e-5))
    d = HybridDims(
        d_model=d_model, n_layer=2 * layers, vocab_size=vocab, norm_eps=eps,
        kinds=tuple(k for i in range(layers) for k in (ATTENTION if i in attn else SSM, MLP)),
        d_inner=d_inner, d_state=get("mamba_d_state", 256), d_conv=get("mamba_d_conv", 4),
        ngroups=get("mamba_n_groups", 1),
        headdim=d_inner // nheads if d_head == "auto" and nheads > 0 else get("mamba_d_head", REQUIRED),
        nheads=nheads, chunk_size=get("mamba_chunk_size", 256), gnorm_eps=eps, n_heads=n_heads,
        n_kv_heads=config_int(cfg, "num_key_value_heads", 0) or n_heads, head_dim=head_dim,
        rope_theta=_number(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        rope_dim=int(head_dim * _number(rope.get("partial_rotary_factor", 0.5))),
        d_ff=get("intermediate_size", REQUIRED))
    check_hybrid_dims(d)
    return d


def check_hybrid_dims(d: HybridDims) -> None:
    """Sizes and their relations of any hybrid's dims; ValueError naming the keys."""
    sizes = {k: getattr(d, k) for k in ("d_model", "n_layer", "d_inner", "d_state", "d_conv", "ngroups", "headdim",
                                         "nheads", "chunk_size", "n_heads", "n_kv_heads", "head_dim", "d_ff")}
    bad = [f"{k}={v}" for k, v in sizes.items() if not 0 < v <= 1 << 20]
    if bad:
        raise ValueError(f"sizes must be positive integers up to 2^20, got {', '.join(bad)}")
    if d.nheads * d.headdim != d.d_inner or d.nheads % d.ngroups:
        raise ValueError(f"mamba_n_heads * mamba_d_head = {d.nheads} * {d.headdim} must be mamba_expand * "
                         f"hidden_size = {d.d_inner}, and mamba_n_groups={d.ngroups} must divide mamba_n_heads")
    if d.n_heads % d.n_kv_heads or d.rope_dim % 2 or d.rope_dim > d.head_dim:  # rope_dim 0: no RoPE
        raise ValueError(f"num_key_value_heads={d.n_kv_heads} must divide num_attention_heads={d.n_heads}, and the "
                         f"rotary width {d.rope_dim} must be even and at most head_dim={d.head_dim}")
    if not (math.isfinite(d.norm_eps) and 0.0 < d.norm_eps < 1.0) or not (math.isfinite(d.rope_theta) and d.rope_theta > 0):
        raise ValueError(f"rms_norm_eps must be in (0, 1) and rope_theta positive, got {d.norm_eps}, {d.rope_theta}")


def bamba_block_keys(dims: HybridDims):
    """block -> {canonical name: checkpoint key} (checkpoints.loading.Checkpoint.block_keys)."""
    def keys(block: int) -> dict[str, str]:
        return {name: f"model.layers.{block // 2}.{suffix}" for name, suffix in _TENSORS[dims.kinds[block]].items()}
    return keys


def _expected(d: HybridDims, kind: str) -> dict[str, set[tuple[int, ...]]]:
    one = lambda *s: {tuple(s)}  # noqa: E731
    if kind == SSM:
        return {"norm_weight": one(d.d_model), "in_proj": one(2 * d.d_inner + 2 * d.ngroups * d.d_state + d.nheads, d.d_model),
                "conv_weight": {(d.conv_dim, 1, d.d_conv), (d.conv_dim, d.d_conv)}, "conv_bias": one(d.conv_dim),
                "dt_bias": one(d.nheads), "A_log": one(d.nheads), "D": one(d.nheads), "gnorm_weight": one(d.d_inner),
                "out_proj": one(d.d_model, d.d_inner)}
    if kind == ATTENTION:
        q, kv = d.n_heads * d.head_dim, d.n_kv_heads * d.head_dim
        return {"norm_weight": one(d.d_model), "q_proj": one(q, d.d_model), "k_proj": one(kv, d.d_model),
                "v_proj": one(kv, d.d_model), "o_proj": one(d.d_model, q)}
    return {"norm_weight": one(d.d_model), "gate_proj": one(d.d_ff, d.d_model), "up_proj": one(d.d_ff, d.d_model),
            "down_proj": one(d.d_model, d.d_ff)}


def check_hybrid_shapes(ckpt) -> None:
    """Every block tensor of a hybrid checkpoint (headers only) against its dims and its block's kind."""
    d = ckpt.dims
    for block in range(d.n_layer):
        expected = _expected(d, d.kinds[block])
        for name, key in ckpt.block_keys(block).items():
            if not ckpt.has(key):
                if name in _OPTIONAL:
                    continue
                raise ValueError(f"tensor {key!r} is missing; config.json says block {block} is of kind "
                                 f"{d.kinds[block]}")
            got, dtype = ckpt.meta(key)
            if not dtype.is_floating_point or got not in expected[name]:
                want = " or ".join(str(list(s)) for s in expected[name])
                raise ValueError(f"{key} has shape {list(got)} and dtype {dtype}; config.json implies {want}, "
                                 f"floating point")
    width = ckpt.embedding().shape[1]
    if width != d.d_model or not ckpt.embedding().dtype.is_floating_point:
        raise ValueError(f"the embedding has width {width}; it must be floating point of width hidden_size {d.d_model}")


def open_bamba(ckpt, cfg: dict, error: type[Exception]) -> bool:
    """Make a just-indexed checkpoints.loading.Checkpoint a Bamba one when `cfg` is a Bamba config
    (Architecture.open_config); False for another config; `error` (loading's ModelDirError) for one it cannot use."""
    if not is_bamba_config(cfg):
        return False
    try:
        ckpt.format, ckpt.dims = "transformers", bamba_dims(cfg, int(ckpt.embedding().shape[0]))
    except (TypeError, ValueError, KeyError, OverflowError) as e:
        raise error(f"{ckpt.path}/config.json (Bamba): {e}") from None
    ckpt.block_keys, ckpt.optional = bamba_block_keys(ckpt.dims), _OPTIONAL
    ckpt.final_norm_key = "model.final_layernorm.weight"
    try:
        check_hybrid_shapes(ckpt)
    except ValueError as e:
        raise error(f"{ckpt.path}: {e}") from None
    return True
