"""What a Quamba2 W8A8 checkpoint directory declares, checked before any work: config.json (Mamba-2 sizes,
the mixer, norm, embedding and lm_head classes), every key's dtype and shape, every scale's value, the head/dim
group ranges, and the scales Quamba stores twice.

The layout, from enyac-group/Quamba c474646 (files under ``quamba/``): ``W8A8QMamba2`` (qMamba2.py:1071-1257)
holds ``in_proj`` (``W8A8B8O8LinearParallel``, qLinearLayer.py:638-713: weight int8 ``[d_model, pad16(n)]`` a
transposed view, ``a`` fp32 [1, 1], ``b`` fp32 [1, pad16(n)], no ``alpha``), ``conv1d`` (``Quamb2Conv1D``,
qConvLayer.py:129-287: int8 weight and bias, int32 group ranges, fp32 output scales, and nine Python floats
written by its ``store_hook``), ``qchunk_scan`` (``Quamba2ChunkScan``, qChunkScan.py:17-141: fp16 dt_bias, int8
A_log and D with 0-dim fp32 scales, the grouped x, B, C and state scales), ``norm`` (``QRMSNormGated``,
qNorm.py:93-143: fp16 weight, ``z_scale`` a float, ``output_scale`` None with fp16 output), ``had``
(``QHadamard``, qHadamard.py:8-24: ``x_H_scale`` a float) and ``out_proj`` (``W8A8B16O16Linear``,
qLinearLayer.py:745-790). The block's ``norm`` is a ``QRMSNorm`` (qNorm.py:15-43).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ....checkpoints.loading import ModelDirError
from ....architectures.mamba2.config import mamba2_dims
from ..checkpoint import F, T0, T11, pad16
from ..checkpoint_checks import INT, NUM, config_field, show_value, w8a8_head_kinds
from ....spec import Mamba2Dims

__all__ = ["SUPPORTED2", "NONE", "N_HEAD_GROUPS", "N_DIM_GROUPS", "q2_unsupported", "q2_config_dims", "q2_sizes", "q2_layer_spec",
           "check_q2_grouped", "bad_scale", "check_q2_values"]

SUPPORTED2 = ("Quamba2 W8A8 Mamba-2 checkpoints: ssm_cfg.layer W8A8QMamba2, norm_cfg.norm QRMSNorm, "
              "embedding_cfg.layer Embedding or W8O16Embedding, lm_head_cfg.layer Linear or W8A8B16O16Linear, "
              "no attention layers, not hybrid")
NONE = "None"  # a Python None in the state dict (QRMSNormGated.output_scale with fp16 output, qNorm.py:124-129)
N_HEAD_GROUPS = N_DIM_GROUPS = 4  # W8A8QMamba2 fixes x_nhead_group = x_ndim_group = 4 (qMamba2.py:1140-1141)
_W4 = {"W4A8QMamba2": "W4A8 (Marlin-QQQ int4 weights)", "W4A16QMamba2": "W4A16 (Marlin int4 weights)"}


def q2_unsupported(path: Path | None, what: str) -> ModelDirError:
    return ModelDirError(f"{path}: {what} is not supported; supported: {SUPPORTED2}")


def _q2_layer(path: Path | None, cfg: dict, ssm: dict) -> None:
    layer = ssm.get("layer", "W8A8QMamba2")  # quamba_mixer_seq.py:102 defaults to W8A8QMamba2
    if cfg.get("is_hybrid") or isinstance(layer, list):
        raise q2_unsupported(path, "a hybrid W4AX checkpoint (is_hybrid, per-layer ssm_cfg.layer lists)")
    layer = config_field(path, ssm, "layer", "a string", layer, "ssm_cfg.")
    if layer in _W4:
        raise q2_unsupported(path, f"ssm_cfg.layer {layer!r}, {_W4[layer]}")
    if layer != "W8A8QMamba2":
        raise q2_unsupported(path, f"ssm_cfg.layer {layer!r}")


def q2_config_dims(path: Path | None, cfg: dict) -> tuple[Mamba2Dims, dict]:
    """The Mamba2Dims Quamba builds from config.json (W8A8QMamba2's defaults equal Mamba2's, qMamba2.py:1073-1101)
    and the embedding and lm_head kinds; every field checked by type, every size by range."""
    ssm = config_field(path, cfg, "ssm_cfg", "a table", {})
    _q2_layer(path, cfg, ssm)
    if config_field(path, cfg, "attn_layer_idx", "a list", None):
        raise q2_unsupported(path, "a checkpoint with attention layers (attn_layer_idx; Quamba leaves them "
                                   "unquantized, quamba_mixer_seq.py:112)")
    if config_field(path, cfg, "d_intermediate", INT, 0) != 0:
        raise q2_unsupported(path, "a checkpoint with MLP layers (d_intermediate)")
    kinds = w8a8_head_kinds(path, cfg, q2_unsupported)
    return q2_sizes(path, cfg, ssm), kinds


def q2_sizes(path: Path | None, cfg: dict, ssm: dict) -> Mamba2Dims:
    """The Mamba-2 sizes of a Quamba2 config.json (any recipe), every field checked by type and range."""
    for name in ("d_model", "n_layer", "vocab_size"):
        config_field(path, cfg, name, INT)
    for name in ("d_state", "d_conv", "headdim", "ngroups", "chunk_size"):
        config_field(path, ssm, name, INT, 0, "ssm_cfg.")
    config_field(path, ssm, "expand", INT, 2, "ssm_cfg.")
    config_field(path, cfg, "norm_epsilon", NUM, 1e-5)
    mult = config_field(path, cfg, "pad_vocab_size_multiple", INT, 8)
    if not 0 < mult <= 1 << 20:
        raise ModelDirError(f"{path}/config.json: field 'pad_vocab_size_multiple' must be an integer from 1 to "
                            f"2^20, got {show_value(mult)}")
    vocab = cfg["vocab_size"] + (mult - cfg["vocab_size"] % mult) % mult  # quamba_mixer_seq.py:371-372
    try:
        _, dims = mamba2_dims(Path(path or "."), {**cfg, "ssm_cfg": {**ssm, "layer": "Mamba2"}}, vocab)
    except ValueError as e:
        raise ModelDirError(f"{path}/config.json (Quamba2): {e}") from None
    if dims.nheads // dims.ngroups < N_HEAD_GROUPS or dims.headdim < N_DIM_GROUPS:
        raise ModelDirError(f"{path}/config.json: W8A8QMamba2 splits each SSD group's heads into {N_HEAD_GROUPS} "
                            f"head groups and each head into {N_DIM_GROUPS} dim groups; nheads / ngroups = "
                            f"{dims.nheads // dims.ngroups} and headdim = {dims.headdim} must be at least 4")
    return dims


def q2_layer_spec(d: Mamba2Dims, i: int, conv_bias: bool = True) -> dict:
    """key -> (dtype, shape), or a scalar kind (F, T0, T11, NONE), for block i (module docstring)."""
    p, g, hg, dg = f"backbone.layers.{i}.", d.ngroups, N_HEAD_GROUPS, N_DIM_GROUPS
    n_in = 2 * d.d_inner + 2 * g * d.d_state + d.nheads
    m = p + "mixer."
    spec = {p + "norm.weight": (torch.float16, (d.d_model,)), p + "norm.output_scale": F,        # qNorm.py:20, 38-39
            m + "in_proj.weight": (torch.int8, (d.d_model, pad16(n_in))), m + "in_proj.a": T11,  # qLinearLayer.py:655-663
            m + "in_proj.b": (torch.float32, (1, pad16(n_in))),
            m + "conv1d.weight": (torch.int8, (d.conv_dim, d.d_conv))}                           # qConvLayer.py:164-165
    if conv_bias:
        spec[m + "conv1d.bias"] = (torch.int8, (d.conv_dim,))                                    # qConvLayer.py:167-168
    c = m + "conv1d."
    spec.update({c + "x_head_group_range": (torch.int32, (g, hg)), c + "x_dim_group_range": (torch.int32, (g, hg, dg)),
                 c + "x_out_scales": (torch.float32, (g, hg, dg)), c + "B_out_scales": (torch.float32, (g,)),
                 c + "C_out_scales": (torch.float32, (g,))})                                     # qConvLayer.py:179-194
    names = ["x_scale", "B_scale", "C_scale", "wx_scale", "wB_scale", "wC_scale"]                 # qConvLayer.py:273-283
    spec.update({c + n: F for n in names + (["bx_scale", "bB_scale", "bC_scale"] if conv_bias else [])})
    s = m + "qchunk_scan."                                                                        # qChunkScan.py:37-80
    spec.update({s + "dt_bias": (torch.float16, (d.nheads,)), s + "A_log": (torch.int8, (d.nheads,)), s + "A_log_scale": T0,
                 s + "D": (torch.int8, (d.nheads,)), s + "D_scale": T0, s + "dt_scale": T0,
                 s + "ssm_state_scale": (torch.float32, (g, hg, dg, d.d_state)), s + "x_scales": (torch.float32, (g, hg, dg)),
                 s + "x_head_group_range": (torch.int32, (g, hg)), s + "x_dim_group_range": (torch.int32, (g, hg, dg)),
                 s + "B_scale": (torch.float32, (g,)), s + "C_scale": (torch.float32, (g,))})
    spec.update({m + "norm.weight": (torch.float16, (d.d_inner,)), m + "norm.z_scale": F,        # qNorm.py:102-108, 134-137
                 m + "norm.output_scale": NONE, m + "had.x_H_scale": F,                          # qHadamard.py:18-19
                 m + "out_proj.weight": (torch.int8, (d.d_inner, pad16(d.d_model))), m + "out_proj.a": T11,
                 m + "out_proj.b": T11, m + "out_proj.alpha": F})                                # qLinearLayer.py:760-784
    return spec


_SCALE_TABLES = ("conv1d.x_out_scales", "conv1d.B_out_scales", "conv1d.C_out_scales", "qchunk_scan.ssm_state_scale",
                 "qchunk_scan.x_scales", "qchunk_scan.B_scale", "qchunk_scan.C_scale")


def bad_scale(f: Path, key: str, t: torch.Tensor) -> ModelDirError:
    bad = ~(torch.isfinite(t) & (t > 0)).reshape(-1)
    first = int(torch.argmax(bad.to(torch.uint8)))
    return ModelDirError(f"{f}: {key!r} holds {int(bad.sum())} scales that are not finite and > 0 (the first, "
                         f"{float(t.reshape(-1)[first])}, at flat index {first}); a scale must be a finite number > 0")


def _check_ranges(f: Path, sd: dict, key: str, d: Mamba2Dims) -> None:
    """Cumulative group ends (qMamba2.py:57-59): strictly rising, the last one the SSD group's heads (head
    ranges) or headdim (dim ranges), so that every head and channel lies in exactly one group."""
    t = sd[key].to(torch.int64)
    end = d.nheads // d.ngroups if key.endswith("head_group_range") else d.headdim
    starts = torch.cat([torch.zeros_like(t[..., :1]), t[..., :-1]], dim=-1)
    if not bool((t > starts).all()) or not bool((t[..., -1] == end).all()):
        raise ModelDirError(f"{f}: {key!r} is {t.tolist()}; each row must rise strictly from above 0 to {end} "
                            f"({'heads per SSD group' if end == d.nheads // d.ngroups else 'headdim'})")


def _check_same(f: Path, sd: dict, a: str, b: str) -> None:
    va, vb = sd[a], sd[b]
    if isinstance(va, torch.Tensor) and va.numel() > 1:
        same = torch.equal(va, vb)
    else:  # a [1, 1] tensor against a Python float: the same fp32 value
        same = float(va.reshape(()) if isinstance(va, torch.Tensor) else va) == \
            float(vb.reshape(()) if isinstance(vb, torch.Tensor) else vb)
    if not same:
        raise ModelDirError(f"{f}: {a!r} and {b!r} must be equal (Quamba stores one value twice: "
                            f"qMamba2.py:1212-1240), they differ")


def check_q2_grouped(f: Path, sd: dict, d: Mamba2Dims, m: str) -> None:
    """The W8A8/W4A8 activation path of the mixer under prefix m: its scale tables, group ranges, and the
    tensors conv1d and qchunk_scan both store (qMamba2.py:1212-1240)."""
    for key in (m + k for k in _SCALE_TABLES):
        t = sd[key]
        if not bool((torch.isfinite(t) & (t > 0)).all()):
            raise bad_scale(f, key, t)
    for part in ("conv1d", "qchunk_scan"):
        for key in ("x_head_group_range", "x_dim_group_range"):
            _check_ranges(f, sd, f"{m}{part}.{key}", d)
    for a, b_ in (("conv1d.x_head_group_range", "qchunk_scan.x_head_group_range"),
                  ("conv1d.x_dim_group_range", "qchunk_scan.x_dim_group_range"),
                  ("conv1d.x_out_scales", "qchunk_scan.x_scales"), ("conv1d.B_out_scales", "qchunk_scan.B_scale"),
                  ("conv1d.C_out_scales", "qchunk_scan.C_scale")):
        _check_same(f, sd, m + a, m + b_)


def check_q2_values(f: Path, sd: dict, d: Mamba2Dims, i: int) -> None:
    """Block i beyond the standard scalar and float checks: the scale tensors, in_proj's per-column factors,
    the group ranges, and the scales stored twice (conv1d's and qchunk_scan's; norm's and in_proj's input)."""
    m = f"backbone.layers.{i}.mixer."
    check_q2_grouped(f, sd, d, m)
    n_in = 2 * d.d_inner + 2 * d.ngroups * d.d_state + d.nheads
    b = sd[m + "in_proj.b"][0]
    if not bool((torch.isfinite(b[:n_in]) & (b[:n_in] > 0)).all()):
        raise bad_scale(f, m + "in_proj.b", b[:n_in])
    _check_same(f, sd, m + "out_proj.a", m + "had.x_H_scale")
    _check_same(f, sd, m + "in_proj.a", f"backbone.layers.{i}.norm.output_scale")
