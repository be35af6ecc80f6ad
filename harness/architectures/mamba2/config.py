"""Mamba-2 checkpoints: the config keys of both layouts, the block's tensors, and their shapes.

* transformers (``Mamba2ForCausalLM``, ``model_type: mamba2``): ``hidden_size``, ``num_hidden_layers``,
  ``num_heads``, ``head_dim``, ``n_groups``, ``state_size``, ``chunk_size``, ``expand``, ``conv_kernel``,
  ``layer_norm_epsilon`` (also the gated norm's epsilon: transformers 5.23
  models/mamba2/modeling_mamba2.py:430-432, ``MambaRMSNormGated(intermediate_size,
  group_size=intermediate_size // n_groups, eps=layer_norm_epsilon)``); embedding ``backbone.embeddings.weight``;
* mamba_ssm (``MambaConfig`` with ``ssm_cfg: {layer: Mamba2, ...}``): ``d_model``, ``n_layer``, ``ssm_cfg``'s
  ``d_state`` (128), ``d_conv`` (4), ``expand`` (2), ``headdim`` (64), ``ngroups`` (1), ``chunk_size`` (256)
  (state-spaces/mamba e9594ce mamba_ssm/modules/mamba2.py:41-59, ``Mamba2.__init__`` defaults); the gated
  norm is ``RMSNormGated(d_ssm, eps=1e-5, ..., group_size=d_ssm // ngroups)`` (:144); embedding
  ``backbone.embedding.weight``.

Both name the block tensors alike (``backbone.layers.{i}.mixer.in_proj.weight`` ...); in_proj's rows are
[z | xBC | dt] (modeling_mamba2.py:506-508). What the harness does not emulate (biased projections,
d_ssm < d_inner with an MLP part, a time-step limit, norm_before_gate, attention layers) is refused by name.
"""
from __future__ import annotations

import math
from pathlib import Path

from ...spec import Mamba2Dims
from ..config_values import REQUIRED, config_int, config_table
from ..shapes import check_block_shapes

__all__ = ["MAMBA2_LAYER_TENSORS", "MAMBA2_OPTIONAL", "Mamba2ConfigError", "is_mamba2_config", "mamba2_dims",
           "mamba2_expected_shapes", "check_mamba2_shapes", "open_mamba2"]

# canonical name -> key suffix under backbone.layers.{i}.
MAMBA2_LAYER_TENSORS: dict[str, str] = {
    "norm_weight": "norm.weight",
    "in_proj": "mixer.in_proj.weight",
    "conv_weight": "mixer.conv1d.weight",
    "conv_bias": "mixer.conv1d.bias",
    "dt_bias": "mixer.dt_bias",
    "A_log": "mixer.A_log",
    "D": "mixer.D",
    "gnorm_weight": "mixer.norm.weight",
    "out_proj": "mixer.out_proj.weight",
}
MAMBA2_OPTIONAL = {"conv_bias"}


class Mamba2ConfigError(ValueError):
    """A Mamba-2 config the harness does not emulate; the message names the key (loading wraps it)."""


def is_mamba2_config(cfg: dict) -> bool:
    ssm, archs = cfg.get("ssm_cfg"), cfg.get("architectures")
    return cfg.get("model_type") == "mamba2" or (isinstance(archs, list) and "Mamba2ForCausalLM" in archs) \
        or (isinstance(ssm, dict) and ssm.get("layer") == "Mamba2")


def _number(v) -> float:
    """A config number; transformers 5.23 writes a non-finite float as {"__float__": "Infinity"}."""
    return float(v["__float__"]) if isinstance(v, dict) and "__float__" in v else float(v)


def _no_limit(limit) -> bool:
    return limit is None or (len(limit) == 2 and _number(limit[0]) == 0.0 and math.isinf(_number(limit[1]))
                             and _number(limit[1]) > 0)


_TF = "the transformers Mamba-2 layout (model_type mamba2: hidden_size, num_hidden_layers, ...)"


def _transformers(cfg: dict, vocab: int) -> Mamba2Dims:
    if cfg.get("use_bias"):
        raise Mamba2ConfigError("use_bias=true (biased in_proj/out_proj) is not supported")
    if not _no_limit(cfg.get("time_step_limit")):
        raise Mamba2ConfigError(f"time_step_limit={cfg['time_step_limit']} is not supported (only (0, inf))")
    get = lambda key, default: config_int(cfg, key, default, layout=_TF)  # noqa: E731
    d_model, eps = get("hidden_size", REQUIRED), float(cfg.get("layer_norm_epsilon", 1e-5))
    return Mamba2Dims(
        d_model=d_model, d_inner=get("expand", 2) * d_model, d_state=get("state_size", 128),
        d_conv=get("conv_kernel", 4), n_layer=get("num_hidden_layers", REQUIRED), vocab_size=vocab,
        norm_eps=eps, ngroups=get("n_groups", 8), headdim=get("head_dim", 64),
        nheads=get("num_heads", 128), chunk_size=get("chunk_size", 256), gnorm_eps=eps)


def _mamba_ssm(cfg: dict, vocab: int) -> Mamba2Dims:
    ssm = config_table(cfg, "ssm_cfg")
    refused = {"d_intermediate": cfg.get("d_intermediate", 0), "attn_layer_idx": cfg.get("attn_layer_idx") or [],
               "ssm_cfg.bias": ssm.get("bias", False), "ssm_cfg.norm_before_gate": ssm.get("norm_before_gate", False),
               "ssm_cfg.D_has_hdim": ssm.get("D_has_hdim", False), "rms_norm=false": not cfg.get("rms_norm", True),
               "ssm_cfg.rmsnorm=false": not ssm.get("rmsnorm", True)}
    bad = [k for k, v in refused.items() if v]
    if bad:
        raise Mamba2ConfigError(f"{', '.join(bad)} is not supported (MLP, attention layers, biases, "
                                f"norm_before_gate, per-channel D and LayerNorm blocks are not emulated)")
    if not _no_limit(ssm.get("dt_limit")):
        raise Mamba2ConfigError(f"ssm_cfg.dt_limit={ssm['dt_limit']} is not supported (only (0, inf))")
    get = lambda key, default: config_int(ssm, key, default, prefix="ssm_cfg.")  # noqa: E731
    d_model = config_int(cfg, "d_model")
    d_inner = get("expand", 2) * d_model
    if ssm.get("d_ssm") not in (None, d_inner):
        raise Mamba2ConfigError(f"ssm_cfg.d_ssm={ssm['d_ssm']} != expand * d_model = {d_inner} is not supported")
    headdim = get("headdim", 64)
    return Mamba2Dims(
        d_model=d_model, d_inner=d_inner, d_state=get("d_state", 128), d_conv=get("d_conv", 4),
        n_layer=config_int(cfg, "n_layer"), vocab_size=vocab, norm_eps=float(cfg.get("norm_epsilon", 1e-5)),
        ngroups=get("ngroups", 1), headdim=headdim, nheads=d_inner // headdim if headdim > 0 else 0,
        chunk_size=get("chunk_size", 256), gnorm_eps=1e-5)


def mamba2_dims(path: Path, cfg: dict, vocab: int) -> tuple[str, Mamba2Dims]:
    """(layout, dims) of a Mamba-2 config.json; Mamba2ConfigError when a size is unsupported or inconsistent."""
    fmt, d = ("mamba_ssm", _mamba_ssm(cfg, vocab)) if "d_model" in cfg and "n_layer" in cfg \
        else ("transformers", _transformers(cfg, vocab))
    sizes = {k: getattr(d, k) for k in ("d_model", "d_inner", "d_state", "d_conv", "n_layer", "ngroups", "headdim",
                                         "nheads", "chunk_size")}
    bad = [f"{k}={v}" for k, v in sizes.items() if not 0 < v <= 1 << 20]
    if bad:
        raise Mamba2ConfigError(f"sizes must be positive integers up to 2^20, got {', '.join(bad)}")
    if d.nheads * d.headdim != d.d_inner:
        raise Mamba2ConfigError(f"nheads * headdim = {d.nheads} * {d.headdim} != d_inner (expand * d_model) "
                                f"= {d.d_inner}")
    if d.nheads % d.ngroups or d.d_inner % d.ngroups:
        raise Mamba2ConfigError(f"ngroups={d.ngroups} must divide nheads={d.nheads}")
    for name, eps in (("norm epsilon", d.norm_eps), ("gated norm epsilon", d.gnorm_eps)):
        if not (math.isfinite(eps) and 0.0 < eps < 1.0):
            raise Mamba2ConfigError(f"the {name} must be a finite number in (0, 1), got {eps}")
    return fmt, d


def mamba2_expected_shapes(d: Mamba2Dims) -> dict[str, set[tuple[int, ...]]]:
    """canonical name -> the shapes a block tensor may have (conv weight with or without its middle 1)."""
    one = lambda *s: {tuple(s)}  # noqa: E731
    return {
        "norm_weight": one(d.d_model), "in_proj": one(2 * d.d_inner + 2 * d.ngroups * d.d_state + d.nheads, d.d_model),
        "conv_weight": {(d.conv_dim, 1, d.d_conv), (d.conv_dim, d.d_conv)}, "conv_bias": one(d.conv_dim),
        "dt_bias": one(d.nheads), "A_log": one(d.nheads), "D": one(d.nheads), "gnorm_weight": one(d.d_inner),
        "out_proj": one(d.d_model, d.d_inner),
    }


def check_mamba2_shapes(ckpt) -> None:
    """Every block tensor of a Mamba-2 checkpoints.loading.Checkpoint (headers only) against its dims."""
    d = ckpt.dims
    check_block_shapes(ckpt, mamba2_expected_shapes(d), Mamba2ConfigError, model="is a Mamba-2 with",
                       detail=f" (Mamba-2: nheads {d.nheads}, headdim {d.headdim}, ngroups {d.ngroups}, "
                              f"d_state {d.d_state})")


def open_mamba2(ckpt, cfg: dict, error: type[Exception]) -> bool:
    """Make a just-indexed checkpoints.loading.Checkpoint a Mamba-2 one when `cfg` is a Mamba-2 config:
    its tensor table, format and dims, every block's shapes checked. False (nothing done) for another
    config; a config or tensor the harness cannot use raises `error` (loading's ModelDirError) naming it."""
    if not is_mamba2_config(cfg):
        return False
    ckpt.layer_tensors, ckpt.optional = MAMBA2_LAYER_TENSORS, MAMBA2_OPTIONAL
    try:
        ckpt.format, ckpt.dims = mamba2_dims(ckpt.path, cfg, int(ckpt.embedding().shape[0]))
    except (TypeError, ValueError, KeyError, OverflowError) as e:  # Mamba2ConfigError, ConfigValueError: ValueErrors
        raise error(f"{ckpt.path}/config.json (Mamba-2): {e}") from None
    try:
        check_mamba2_shapes(ckpt)
    except Mamba2ConfigError as e:
        raise error(f"{ckpt.path}: {e}") from None
    return True
