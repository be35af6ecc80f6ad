"""Nemotron-H hybrid checkpoints (transformers' ``NemotronHForCausalLM``, ``model_type: nemotron_h``): a second
hybrid family on the same blocks as Bamba's.

Each layer (transformers 5.23 models/nemotron_h/modeling_nemotron_h.py:931-989, ``NemotronHBlock``) is
``h + mixer(norm(h))`` with one mixer by ``layers_block_type`` (older configs: ``hybrid_override_pattern``, M * - E):
a Mamba-2 mixer (``NemotronHMamba2Mixer`` :389-612, d_inner = mamba_num_heads * mamba_head_dim, gated group-wise
RMSNorm, as Mamba2Mixer), attention without positional encoding (``NemotronHAttention`` :869-928: no RoPE), or an
MLP ``down_proj(relu(up_proj(x))^2)`` (``NemotronHMLP`` :637-649, ``mlp_hidden_act: relu2``). So a layer is one
harness block (spec.NemotronHDims). Keys: ``{model|backbone}.layers.{i}.norm.weight``, ``....mixer.*``, the
embedding ``{model|backbone}.embeddings.weight``, ``{model|backbone}.norm_f.weight``. Mixture-of-experts layers
(``moe``, E), biases, another activation and a time-step limit are refused by name.
"""
from __future__ import annotations

import math

from ...spec import NemotronHDims
from ..config_values import REQUIRED, config_int
from .config import ATTENTION, MLP, SSM, check_hybrid_shapes, check_hybrid_dims

__all__ = ["NEMOTRON_MODEL_TYPES", "NEMOTRON_CLASSES", "is_nemotron_config", "nemotron_dims", "open_nemotron_h"]

NEMOTRON_MODEL_TYPES = ("nemotron_h",)
NEMOTRON_CLASSES = ("NemotronHForCausalLM", "NemotronHModel")
_KINDS = {"linear_attention": SSM, "full_attention": ATTENTION, "mlp": MLP, "M": SSM, "*": ATTENTION, "-": MLP}
_TENSORS = {
    SSM: {"norm_weight": "norm.weight", "in_proj": "mixer.in_proj.weight", "conv_weight": "mixer.conv1d.weight",
          "conv_bias": "mixer.conv1d.bias", "dt_bias": "mixer.dt_bias", "A_log": "mixer.A_log", "D": "mixer.D",
          "gnorm_weight": "mixer.norm.weight", "out_proj": "mixer.out_proj.weight"},
    ATTENTION: {"norm_weight": "norm.weight", "q_proj": "mixer.q_proj.weight", "k_proj": "mixer.k_proj.weight",
                "v_proj": "mixer.v_proj.weight", "o_proj": "mixer.o_proj.weight"},
    MLP: {"norm_weight": "norm.weight", "up_proj": "mixer.up_proj.weight", "down_proj": "mixer.down_proj.weight"},
}
_LAYOUT = "the Nemotron-H layout (model_type nemotron_h: hidden_size, layers_block_type, ...)"


def is_nemotron_config(cfg: dict) -> bool:
    archs = cfg.get("architectures")
    return cfg.get("model_type") in NEMOTRON_MODEL_TYPES or (
        isinstance(archs, list) and any(a in NEMOTRON_CLASSES for a in archs))


def _kinds(cfg: dict) -> tuple[str, ...]:
    types = cfg.get("layers_block_type") or cfg.get("layer_types") or cfg.get("hybrid_override_pattern")
    if not isinstance(types, (list, str)) or not types:
        raise ValueError("'layers_block_type' (or 'hybrid_override_pattern') must list the layers' kinds")
    unknown = sorted({t for t in types if t not in _KINDS})
    if unknown:
        raise ValueError(f"layer kind(s) {', '.join(map(repr, unknown))} are not supported (mixture-of-experts "
                         f"layers are not emulated); supported: linear_attention (M), full_attention (*), mlp (-)")
    return tuple(_KINDS[t] for t in types)


def nemotron_dims(cfg: dict, vocab: int) -> NemotronHDims:
    """The dims of a Nemotron-H config.json; ValueError naming the key for a value the harness cannot use."""
    limit = cfg.get("time_step_limit")
    num = lambda v: float(v["__float__"]) if isinstance(v, dict) and "__float__" in v else float(v)  # noqa: E731
    bad = [k for k in ("attention_bias", "mlp_bias", "mamba_proj_bias", "use_bias") if cfg.get(k)]
    bad += [f"{k}={cfg[k]!r}" for k, ok in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu"))
            if cfg.get(k, ok) != ok]
    if limit is not None and not (len(limit) == 2 and num(limit[0]) == 0.0 and math.isinf(num(limit[1]))):
        bad.append(f"time_step_limit={limit}")
    if bad:
        raise ValueError(f"{', '.join(bad)} is not supported")
    get = lambda key, default: config_int(cfg, key, default, layout=_LAYOUT)  # noqa: E731
    kinds, n_heads = _kinds(cfg), get("num_attention_heads", 32)
    nheads, headdim, eps = get("mamba_num_heads", 128), get("mamba_head_dim", 64), float(cfg.get("layer_norm_epsilon", 1e-5))
    d = NemotronHDims(
        d_model=get("hidden_size", REQUIRED), n_layer=len(kinds), vocab_size=vocab, norm_eps=eps, kinds=kinds,
        d_inner=nheads * headdim, d_state=get("ssm_state_size", 128), d_conv=get("conv_kernel", 4),
        ngroups=get("n_groups", 8), headdim=headdim, nheads=nheads, chunk_size=get("chunk_size", 128),
        gnorm_eps=eps, n_heads=n_heads, n_kv_heads=config_int(cfg, "num_key_value_heads", 0) or n_heads,
        head_dim=get("head_dim", 128), rope_theta=10000.0, rope_dim=0, d_ff=get("intermediate_size", REQUIRED),
        mlp_act="relu2")
    check_hybrid_dims(d)
    return d


def open_nemotron_h(ckpt, cfg: dict, error: type[Exception]) -> bool:
    """Make a just-indexed checkpoints.loading.Checkpoint a Nemotron-H one when `cfg` is a Nemotron-H config
    (Architecture.open_config); False for another config; `error` (loading's ModelDirError) for one it cannot use."""
    if not is_nemotron_config(cfg):
        return False
    try:
        ckpt.format, ckpt.dims = "transformers", nemotron_dims(cfg, int(ckpt.embedding().shape[0]))
    except (TypeError, ValueError, KeyError, OverflowError) as e:
        raise error(f"{ckpt.path}/config.json (Nemotron-H): {e}") from None
    prefix = "model" if ckpt.has("model.embeddings.weight") else "backbone"
    kinds = ckpt.dims.kinds
    ckpt.block_keys = lambda b: {n: f"{prefix}.layers.{b}.{s}" for n, s in _TENSORS[kinds[b]].items()}
    ckpt.optional, ckpt.final_norm_key = {"conv_bias"}, f"{prefix}.norm_f.weight"
    try:
        check_hybrid_shapes(ckpt)
    except ValueError as e:
        raise error(f"{ckpt.path}: {e}") from None
    return True
