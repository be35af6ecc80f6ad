"""What a Quamba1 checkpoint directory declares, checked before any work: config.json's fields by type and
range, the blocks the state dict holds against ``n_layer``, and every scale and float weight by value.

A hostile or corrupt file is a ``ModelDirError`` naming the field or key and what is valid: a field of the
wrong type (``ssm_cfg: [1]``, ``norm_cfg: "x"``, ``pad_vocab_size_multiple: 0``), an ``n_layer`` the state
dict does not hold (``10**6`` would otherwise build a key table for a million blocks), a scale that is NaN,
infinite, 0 or negative (it would quantize every activation to code 0 and run to "ok"), a float weight
holding NaN or Inf, a norm epsilon outside (0, 1).
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from ...checkpoints.loading import ModelDirError, check_dims
from ...spec import ModelDims

__all__ = ["SUPPORTED", "unsupported", "config_dims", "mamba1_sizes", "check_blocks_present", "check_values",
           "INT", "NUM", "show_value", "config_field", "layer_kind"]

SUPPORTED = ("Quamba1 W8A8 Mamba-1 checkpoints: ssm_cfg.layer W8A8QMamba, norm_cfg.norm QRMSNorm, "
             "embedding_cfg.layer Embedding or W8O16Embedding, lm_head_cfg.layer Linear or W8A8B16O16Linear")
_REQUIRED = object()
INT, NUM = "an integer", "a number"
_JSON = {INT: "integer", NUM: "number", "a string": "string", "a table": "object", "a list": "array"}


def unsupported(path: Path | None, what: str) -> ModelDirError:
    return ModelDirError(f"{path}: {what} is not supported; supported: {SUPPORTED}")


def show_value(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def config_field(path: Path | None, table: dict, name: str, kind: str, default=_REQUIRED, prefix: str = ""):
    """table[name] checked against kind (an integer, a number, a string, a table, a list); a missing or null
    field takes default; a missing required field is the KeyError open_quamba reports."""
    if name not in table or (table[name] is None and default is not _REQUIRED):
        if default is _REQUIRED:
            raise KeyError(prefix + name)
        return default
    value = table[name]
    ok = {INT: lambda v: type(v) is int, NUM: lambda v: type(v) in (int, float),
          "a string": lambda v: type(v) is str, "a table": lambda v: isinstance(v, dict),
          "a list": lambda v: isinstance(v, list)}[kind](value)
    if not ok:
        raise ModelDirError(f"{path}/config.json: field {prefix + name!r} must be {kind} "
                            f"(a JSON {_JSON[kind]}), got {show_value(value)}")
    return value


def layer_kind(path: Path | None, table: dict, name: str, prefix: str, default: str) -> str:
    return config_field(path, config_field(path, table, prefix, "a table", {}), name, "a string", default, prefix + ".")


def w8a8_head_kinds(path: Path | None, cfg: dict, refuse) -> dict:
    """The W8A8 checkpoint's norm (QRMSNorm), embedding and lm_head classes, each one Quamba's W8A8 writes, else
    ``refuse(path, what)`` (the caller's ModelDirError naming what is supported)."""
    norm = layer_kind(path, cfg, "norm", "norm_cfg", "QRMSNorm")
    if norm != "QRMSNorm":
        raise refuse(path, f"norm_cfg.norm {norm!r}")
    kinds = {"embedding": layer_kind(path, cfg, "layer", "embedding_cfg", "Embedding"),  # quamba_mixer_seq.py:290
             "lm_head": layer_kind(path, cfg, "layer", "lm_head_cfg", "Linear")}  # quamba_mixer_seq.py:412
    if kinds["embedding"] not in ("Embedding", "W8O16Embedding"):
        raise refuse(path, f"embedding_cfg.layer {kinds['embedding']!r}")
    if kinds["lm_head"] not in ("Linear", "W8A8B16O16Linear"):
        raise refuse(path, f"lm_head_cfg.layer {kinds['lm_head']!r}")
    return kinds


def config_dims(path: Path | None, cfg: dict) -> tuple[ModelDims, dict]:
    """The sizes Quamba builds from config.json (quamba_mixer_seq.py, qMambaLayer.py:761-788 defaults), and
    the embedding and lm_head kinds; every field checked by type, every size by range (loading.check_dims)."""
    ssm = config_field(path, cfg, "ssm_cfg", "a table", {})
    layer = ssm.get("layer", "W8A8QMamba2")  # quamba_mixer_seq.py:102 defaults to Mamba-2
    if cfg.get("is_hybrid") or isinstance(layer, list):
        raise unsupported(path, "a hybrid (per-layer W4/W8 mix, is_hybrid) checkpoint")
    layer = config_field(path, ssm, "layer", "a string", layer, "ssm_cfg.")
    if layer.endswith("Mamba2"):
        raise unsupported(path, f"a Mamba-2 (Quamba2) checkpoint (ssm_cfg.layer {layer!r})")
    if layer != "W8A8QMamba":
        raise unsupported(path, f"ssm_cfg.layer {layer!r} (4-bit weights)")
    kinds = w8a8_head_kinds(path, cfg, unsupported)
    return mamba1_sizes(path, cfg, ssm, unsupported), kinds


def mamba1_sizes(path: Path | None, cfg: dict, ssm: dict, refuse) -> ModelDims:
    """config_dims's sizes of a Mamba-1 Quamba config (also Quamba2's W4 Mamba-1 checkpoints, recipes.quamba.w4.checkpoint_mamba1);
    ``refuse(path, what)``: the caller's ModelDirError for an MLP or attention layer."""
    if config_field(path, cfg, "d_intermediate", INT, 0) != 0 or config_field(path, cfg, "attn_layer_idx", "a list", None):
        raise refuse(path, "a checkpoint with MLP (d_intermediate) or attention layers")
    d_model = config_field(path, cfg, "d_model", INT)
    rank = ssm.get("dt_rank", "auto")
    if rank != "auto":
        rank = config_field(path, ssm, "dt_rank", INT, prefix="ssm_cfg.")
    vocab = config_field(path, cfg, "vocab_size", INT)
    mult = config_field(path, cfg, "pad_vocab_size_multiple", INT, 8)
    if not 0 < mult <= 1 << 20:
        raise ModelDirError(f"{path}/config.json: field 'pad_vocab_size_multiple' must be an integer from 1 to "
                            f"2^20, got {show_value(mult)}")
    vocab += (mult - vocab % mult) % mult  # quamba_mixer_seq.py:371-372
    expand = config_field(path, ssm, "expand", NUM, 2, "ssm_cfg.")
    eps = config_field(path, cfg, "norm_epsilon", NUM, 1e-5)
    d_inner = expand * d_model  # an int, or a float that may be inf (refused by check_dims as 0)
    dims = ModelDims(d_model=d_model, d_inner=int(d_inner) if math.isfinite(d_inner) else 0,
                     d_state=config_field(path, ssm, "d_state", INT, 16, "ssm_cfg."),
                     d_conv=config_field(path, ssm, "d_conv", INT, 4, "ssm_cfg."),
                     dt_rank=-(-d_model // 16) if rank == "auto" else rank,  # ceil, exact for any int
                     n_layer=config_field(path, cfg, "n_layer", INT), vocab_size=vocab, norm_eps=float(eps))
    check_dims(path, dims)
    return dims


_BLOCK = re.compile(r"backbone\.layers\.(\d+)\.")


def check_blocks_present(f: Path, sd: dict, n_layer: int) -> None:
    """config.json's n_layer against the blocks the state dict holds, before a key table is built per block."""
    present = {int(m.group(1)) for k in sd if isinstance(k, str) and (m := _BLOCK.match(k))}
    missing = next((i for i in range(n_layer) if i not in present), None)
    if missing is not None:
        raise ModelDirError(f"{f}: config.json declares n_layer = {n_layer} but the state dict holds "
                            f"{len(present)} blocks (block {missing}, keys 'backbone.layers.{missing}.*', is missing); "
                            f"n_layer must be the number of blocks saved")


def _first_bad(t: torch.Tensor) -> tuple[int, int]:
    bad = ~torch.isfinite(t.reshape(-1))
    return int(bad.sum()), int(torch.argmax(bad.to(torch.uint8)))


def check_values(f: Path, sd: dict, expected: dict) -> None:
    """Every entry by value: a scale (a Python float or an fp32 scalar tensor) finite and > 0, a float tensor
    (norm weights, fp16 embedding and lm_head, W8O16Embedding's row scales) finite; int8 codes are always valid.
    Every scale Quamba writes is > 0: absmax / 127 with the absmax clamped at 1e-5, ratios of those, 1.0 for a
    conv without bias (enyac-group/Quamba c474646, quamba/qConvLayer.py:53-72)."""
    for key, kind in expected.items():
        v = sd[key]
        if not isinstance(kind, tuple):
            x = v if type(v) is float else float(v.reshape(()))
            if not (math.isfinite(x) and x > 0):
                raise ModelDirError(f"{f}: {key!r} is {x}; a scale must be a finite number > 0")
        elif v.dtype.is_floating_point and not bool(torch.isfinite(v).all()):
            count, first = _first_bad(v)
            raise ModelDirError(f"{f}: {key!r} holds {count} NaN or Inf values (the first at flat index {first}); "
                                f"weights must be finite")
