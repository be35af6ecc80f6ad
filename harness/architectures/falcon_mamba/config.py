"""Falcon-Mamba checkpoints (transformers' ``FalconMambaForCausalLM``, ``model_type: falcon_mamba``).

The layout is transformers' Mamba-1 one (``backbone.embeddings.weight``, ``backbone.layers.{i}.norm.weight``,
``backbone.layers.{i}.mixer.{in_proj,conv1d,x_proj,dt_proj,out_proj,A_log,D}``, ``backbone.norm_f.weight``); the
config adds ``mixer_rms_eps`` (default 1e-6), the epsilon of the weightless dt/B/C norms, whose ``weight`` buffers
are not persistent and so not in the checkpoint (transformers 5.23
models/falcon_mamba/configuration_falcon_mamba.py:73-106: ``intermediate_size = expand * hidden_size``, whatever
config.json says, ``time_step_rank`` "auto" is ceil(hidden_size / 16); modeling_falcon_mamba.py:46-51, 350-352).
"""
from __future__ import annotations

import math

from ...spec import FalconMambaDims
from ..config_values import REQUIRED, config_int
from ..shapes import check_block_shapes

__all__ = ["FALCON_MODEL_TYPES", "FALCON_CLASSES", "FALCON_LAYER_TENSORS", "is_falcon_mamba_config",
           "falcon_mamba_dims", "check_falcon_mamba_shapes", "open_falcon_mamba"]

FALCON_MODEL_TYPES = ("falcon_mamba",)
FALCON_CLASSES = ("FalconMambaForCausalLM", "FalconMambaModel")
# canonical name -> key suffix under backbone.layers.{i} (the Mamba-1 names: the weight bank reads them alike)
FALCON_LAYER_TENSORS: dict[str, str] = {
    "norm_weight": "norm.weight", "in_proj": "mixer.in_proj.weight", "conv_weight": "mixer.conv1d.weight",
    "conv_bias": "mixer.conv1d.bias", "x_proj": "mixer.x_proj.weight", "dt_proj": "mixer.dt_proj.weight",
    "dt_bias": "mixer.dt_proj.bias", "A_log": "mixer.A_log", "D": "mixer.D", "out_proj": "mixer.out_proj.weight",
}
_OPTIONAL = {"conv_bias"}
_LAYOUT = "the Falcon-Mamba layout (model_type falcon_mamba: hidden_size, num_hidden_layers, ...)"


def is_falcon_mamba_config(cfg: dict) -> bool:
    archs = cfg.get("architectures")
    return cfg.get("model_type") in FALCON_MODEL_TYPES or (
        isinstance(archs, list) and any(a in FALCON_CLASSES for a in archs))


def falcon_mamba_dims(cfg: dict, vocab: int) -> FalconMambaDims:
    """The dims of a Falcon-Mamba config.json; ValueError naming the key for a value it cannot use."""
    if cfg.get("use_bias"):
        raise ValueError("use_bias=true (biased in_proj/out_proj) is not supported by Quamba's W8A8 kernels")
    get = lambda key, default: config_int(cfg, key, default, layout=_LAYOUT)  # noqa: E731
    d_model = get("hidden_size", REQUIRED)
    rank = cfg.get("time_step_rank", "auto")
    d = FalconMambaDims(
        d_model=d_model, d_inner=get("expand", 2) * d_model, d_state=get("state_size", 16),
        d_conv=get("conv_kernel", 4), dt_rank=math.ceil(d_model / 16) if rank == "auto" else get("time_step_rank", 0),
        n_layer=get("num_hidden_layers", REQUIRED), vocab_size=vocab,
        norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)), mixer_rms_eps=float(cfg.get("mixer_rms_eps", 1e-6)))
    sizes = {k: getattr(d, k) for k in ("d_model", "d_inner", "d_state", "d_conv", "dt_rank", "n_layer")}
    bad = [f"{k}={v}" for k, v in sizes.items() if not 0 < v <= 1 << 20]
    if bad:
        raise ValueError(f"sizes must be positive integers up to 2^20, got {', '.join(bad)}")
    for name, eps in (("layer_norm_epsilon", d.norm_eps), ("mixer_rms_eps", d.mixer_rms_eps)):
        if not (math.isfinite(eps) and 0.0 < eps < 1.0):
            raise ValueError(f"{name} must be a finite number in (0, 1), got {eps}")
    return d


def _expected(d: FalconMambaDims) -> dict[str, set[tuple[int, ...]]]:
    one = lambda *s: {tuple(s)}  # noqa: E731
    return {"norm_weight": one(d.d_model), "in_proj": one(2 * d.d_inner, d.d_model),
            "conv_weight": {(d.d_inner, 1, d.d_conv), (d.d_inner, d.d_conv)}, "conv_bias": one(d.d_inner),
            "x_proj": one(d.dt_rank + 2 * d.d_state, d.d_inner), "dt_proj": one(d.d_inner, d.dt_rank),
            "dt_bias": one(d.d_inner), "A_log": one(d.d_inner, d.d_state), "D": one(d.d_inner),
            "out_proj": one(d.d_model, d.d_inner)}


def check_falcon_mamba_shapes(ckpt) -> None:
    """Every block tensor of a checkpoints.loading.Checkpoint (headers only) against its dims; ValueError."""
    check_block_shapes(ckpt, _expected(ckpt.dims))


def open_falcon_mamba(ckpt, cfg: dict, error: type[Exception]) -> bool:
    """Make a just-indexed checkpoints.loading.Checkpoint a Falcon-Mamba one when `cfg` is a Falcon-Mamba config
    (Architecture.open_config); False for another config; `error` (loading's ModelDirError) for one it cannot use."""
    if not is_falcon_mamba_config(cfg):
        return False
    ckpt.layer_tensors, ckpt.optional = FALCON_LAYER_TENSORS, _OPTIONAL
    try:
        ckpt.format, ckpt.dims = "transformers", falcon_mamba_dims(cfg, int(ckpt.embedding().shape[0]))
    except (TypeError, ValueError, KeyError, OverflowError) as e:
        raise error(f"{ckpt.path}/config.json (Falcon-Mamba): {e}") from None
    try:
        check_falcon_mamba_shapes(ckpt)
    except ValueError as e:
        raise error(f"{ckpt.path}: {e}") from None
    return True
