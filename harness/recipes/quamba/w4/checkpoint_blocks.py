"""Quamba2 W4A8, W4A16 and hybrid W4AX checkpoints: every block key checked, the Marlin linears unpacked into
``Int4Weight`` (kernels.marlin), the activation scales and the other tensors handed back validated.

``read_w4_blocks`` gives one ``W4Block`` per layer and recipe; recipes.quamba.w4.checkpoint_mamba2 runs the q2-w4a8 and
q2-w4a16 modes from them. enyac-group/Quamba c474646:

* non-hybrid: ``ssm_cfg.layer`` ``W4A8QMamba2`` or ``W4A16QMamba2`` (qMamba2.py:735-1066, 381-733), keys under
  ``backbone.layers.{i}.mixer.`` and ``.norm.``;
* hybrid (``is_hybrid``, modelutils_mamba.py:874-900): ``ssm_cfg.layer`` a list with one
  ``{recipe: mixer class}`` table per layer and ``norm_cfg.norm`` one ``{recipe: norm class}`` table, recipes
  ``W4A8`` and ``W4A16`` (modelutils_mamba.py:676-680); ``HybridQuambaBlock`` (qBlock.py:6-200) keeps them in
  ModuleDicts: keys under ``backbone.layers.{i}.mixers.{recipe}.`` and ``.norms.{recipe}.``.

Linears: ``W4A8B8O8LinearParallel`` (in_proj) and ``W4A8B16O16Linear`` (out_proj) hold ``workspace`` int32,
``weight`` int32 [K/16, 2N], ``input_scale`` fp32 [], ``s_channel`` fp32 [1, N], ``s_group`` fp16 [K/128, N], N
the out-features padded to 64 (qLinearLayer.py:139-215, 420-505); in_proj's ``s_channel`` has each split's
output scale divided in (marlin_utils.py:255-256), so ``Int4Weight.channel_scales`` of in_proj is s_channel /
s_out. ``W4A16B16O16Linear`` holds ``workspace``, ``weight`` and ``scale`` fp16 [K/128, N], N padded to 256
(:13-75). The W4A8 mixer's conv1d, qchunk_scan, norm and had are W8A8QMamba2's (quamba2_checks); the W4A16
mixer keeps the fp16 model's conv1d (weight [C, 1, K], bias), dt_bias, A_log, D and the gated norm's weight.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ....checkpoints.loading import ModelDirError, refuse_in
from ..checkpoint import F, T0, describe_kind, kind_ok, read_config, check_spec, load_state_dict, parse_config
from ..q2.checkpoint_checks import bad_scale, check_q2_grouped, q2_layer_spec, q2_sizes, q2_unsupported
from ..checkpoint_checks import config_field, check_blocks_present, check_values
from ....kernels.int4 import Int4Weight
from ....kernels.marlin import unpack_marlin, unpack_marlin_qqq
from ....spec import Mamba2Dims
from ....store.files import is_regular

__all__ = ["W4Block", "W4_MIXERS", "w4_plan", "w4_block_spec", "read_w4_blocks", "check_w4_blocks", "load_w4",
           "marlin_spec", "w4_kind_ok", "w4_describe_kind", "check_marlin"]

W4_MIXERS = {"W4A8QMamba2": "W4A8", "W4A16QMamba2": "W4A16"}
_NORMS = {"W4A8": "QRMSNorm", "W4A16": "RMSNorm"}  # quantize_norm_a8 / the fp16 norm (modelutils_mamba.py:516-572)
FLOAT = "float"  # any floating dtype (the W4A16 mixer keeps the fp16 model's tensors: fp16, D fp32)


@dataclass(frozen=True)
class W4Block:
    """One W4 mixer of one layer: recipe "W4A8" or "W4A16"; in_proj, out_proj unpacked; input scales (W4A8:
    in_proj's and out_proj's ``input_scale``; W4A16: None); `tensors`: every other key of the mixer and its norm
    (suffix after the mixer's or norm's prefix, "norm:" for the block norm), validated."""

    recipe: str
    in_proj: Int4Weight
    out_proj: Int4Weight
    in_scale: float | None
    out_scale: float | None
    tensors: dict


def _pad(n: int, m: int) -> int:
    return -(-n // m) * m


def w4_plan(path: Path | None, cfg: dict) -> tuple[Mamba2Dims, list[list[tuple[str, str, str]]]]:
    """(dims, per layer the (recipe, mixer prefix, norm prefix) of each mixer it stores)."""
    ssm = config_field(path, cfg, "ssm_cfg", "a table", {})
    layer = ssm.get("layer", "W8A8QMamba2")
    dims = q2_sizes(path, cfg, ssm)
    if config_field(path, cfg, "attn_layer_idx", "a list", None):
        raise q2_unsupported(path, "a checkpoint with attention layers (attn_layer_idx)")
    if not (cfg.get("is_hybrid") or isinstance(layer, list)):
        if layer not in W4_MIXERS:
            raise q2_unsupported(path, f"ssm_cfg.layer {layer!r} as a W4 checkpoint (W4A8QMamba2 or W4A16QMamba2)")
        recipe = W4_MIXERS[layer]
        return dims, [[(recipe, f"backbone.layers.{i}.mixer.", f"backbone.layers.{i}.norm.")] for i in range(dims.n_layer)]
    norms = (cfg.get("norm_cfg") or {}).get("norm") if isinstance(cfg.get("norm_cfg"), dict) else None
    if not isinstance(layer, list) or len(layer) != dims.n_layer or not isinstance(norms, list) or len(norms) != dims.n_layer:
        raise ModelDirError(f"{path}/config.json: a hybrid checkpoint needs ssm_cfg.layer and norm_cfg.norm as lists of "
                            f"n_layer = {dims.n_layer} tables {{recipe: class}} (modelutils_mamba.py:884-893)")
    plan = []
    for i, (mixers, norm) in enumerate(zip(layer, norms)):
        ok = isinstance(mixers, dict) and isinstance(norm, dict) and mixers and set(mixers) == set(norm) and all(
            W4_MIXERS.get(c) == r and norm[r] == _NORMS[r] for r, c in mixers.items())
        if not ok:
            raise ModelDirError(f"{path}/config.json: layer {i}: ssm_cfg.layer {mixers!r} with norm_cfg.norm {norm!r}; "
                                f"valid: {{'W4A8': 'W4A8QMamba2'}} with {{'W4A8': 'QRMSNorm'}}, {{'W4A16': "
                                f"'W4A16QMamba2'}} with {{'W4A16': 'RMSNorm'}}, or both")
        p = f"backbone.layers.{i}."
        plan.append([(r, f"{p}mixers.{r}.", f"{p}norms.{r}.") for r in mixers])
    return dims, plan


def marlin_spec(m: str, name: str, k: int, n: int, w4a8: bool) -> dict:
    n_pad = _pad(n, 64 if w4a8 else 256)
    spec = {f"{m}{name}.workspace": (torch.int32, ((n_pad // 64) * 16,)),
            f"{m}{name}.weight": (torch.int32, (k // 16, n_pad * 2))}
    if w4a8:
        spec.update({f"{m}{name}.input_scale": T0, f"{m}{name}.s_channel": (torch.float32, (1, n_pad)),
                     f"{m}{name}.s_group": (torch.float16, (k // 128, n_pad))})
    else:
        spec[f"{m}{name}.scale"] = (torch.float16, (k // 128, n_pad))
    return spec


def w4_block_spec(d: Mamba2Dims, i: int, recipe: str, m: str, nrm: str, conv_bias: bool = True) -> dict:
    """key -> kind for one W4 mixer (module docstring); FLOAT tensors as (FLOAT, shape)."""
    n_in = 2 * d.d_inner + 2 * d.ngroups * d.d_state + d.nheads
    spec = {nrm + "weight": (torch.float16, (d.d_model,))}
    spec.update(marlin_spec(m, "in_proj", d.d_model, n_in, recipe == "W4A8"))
    if recipe == "W4A8":
        spec[nrm + "output_scale"] = F
        base, bm = q2_layer_spec(d, i, conv_bias), f"backbone.layers.{i}.mixer."
        spec.update({m + k[len(bm):]: v for k, v in base.items()
                     if k.startswith(bm) and not k[len(bm):].startswith(("in_proj.", "out_proj."))})
    else:
        spec.update({m + "conv1d.weight": (FLOAT, (d.conv_dim, 1, d.d_conv)), m + "dt_bias": (FLOAT, (d.nheads,)),
                     m + "A_log": (FLOAT, (d.nheads,)), m + "D": (FLOAT, (d.nheads,)),
                     m + "norm.weight": (FLOAT, (d.d_inner,))})
        if conv_bias:
            spec[m + "conv1d.bias"] = (FLOAT, (d.conv_dim,))
    spec.update(marlin_spec(m, "out_proj", d.d_inner, d.d_model, recipe == "W4A8"))
    return spec


def w4_kind_ok(v, kind) -> bool:
    if isinstance(kind, tuple) and kind[0] == FLOAT:
        return isinstance(v, torch.Tensor) and v.dtype.is_floating_point and tuple(v.shape) == kind[1]
    return (v is None) if kind == "None" else kind_ok(v, kind)


def w4_describe_kind(kind) -> str:
    if isinstance(kind, tuple) and kind[0] == FLOAT:
        return f"a floating-point tensor of shape {list(kind[1])}"
    return "None" if kind == "None" else describe_kind(kind)


def check_marlin(f: Path, sd: dict, m: str, name: str, n: int, w4a8: bool) -> None:
    """Scales: s_channel's columns finite and > 0, group scales finite and >= 0 (an all-zero group has scale 0)."""
    key = f"{m}{name}.s_group" if w4a8 else f"{m}{name}.scale"
    bad = ~(torch.isfinite(sd[key]) & (sd[key] >= 0))
    if bool(bad.any()):
        raise ModelDirError(f"{f}: {key!r} holds {int(bad.sum())} group scales that are negative, NaN or infinite; "
                            f"a group scale must be a finite number >= 0")
    if w4a8:
        t = sd[f"{m}{name}.s_channel"][0, :n]
        if not bool((torch.isfinite(t) & (t > 0)).all()):
            raise bad_scale(f, f"{m}{name}.s_channel", t)


def load_w4(path: Path) -> tuple[dict, dict, Path]:
    """(config, state dict, the state dict's file) of a checkpoint directory, or ModelDirError."""
    cfg = read_config(path)
    if cfg is None:
        raise ModelDirError(f"{path}: config.json is missing or not a JSON object")
    f = path / "pytorch_model.bin"
    if not is_regular(f, refuse_in(f)):
        raise ModelDirError(f"{path}: pytorch_model.bin is missing")
    return cfg, load_state_dict(f), f


def read_w4_blocks(path: Path | str) -> tuple[Mamba2Dims, list[dict[str, W4Block]]]:
    """Every block of a W4A8/W4A16/hybrid Quamba2 checkpoint, checked (exit-2 ModelDirError naming the key) and
    unpacked: per layer, recipe -> W4Block. The embedding and lm_head are not read (module docstring)."""
    path = Path(path)
    cfg, sd, f = load_w4(path)
    return check_w4_blocks(path, cfg, sd, f)


def check_w4_blocks(path: Path, cfg: dict, sd: dict, f: Path) -> tuple[Mamba2Dims, list[dict[str, W4Block]]]:
    """read_w4_blocks on a config and state dict already loaded (f: the state dict's file, for messages)."""
    dims, plan = parse_config(path, cfg, w4_plan)
    check_blocks_present(f, sd, dims.n_layer)
    n_in = 2 * dims.d_inner + 2 * dims.ngroups * dims.d_state + dims.nheads
    out = []
    for i, mixers in enumerate(plan):
        layer = {}
        for recipe, m, nrm in mixers:
            spec = w4_block_spec(dims, i, recipe, m, nrm, m + "conv1d.bias" in sd)
            check_spec(f, sd, spec, f"a {recipe} Quamba2 block", w4_kind_ok, w4_describe_kind)
            check_values(f, sd, {k: v for k, v in spec.items() if v != "None"})  # scalars > 0, float tensors finite
            w4a8 = recipe == "W4A8"
            check_marlin(f, sd, m, "in_proj", n_in, w4a8)
            check_marlin(f, sd, m, "out_proj", dims.d_model, w4a8)
            if w4a8:
                check_q2_grouped(f, sd, dims, m)
            layer[recipe] = _block(sd, recipe, m, nrm, (n_in, dims.d_model), spec)
        out.append(layer)
    return dims, out


def _block(sd: dict, recipe: str, m: str, nrm: str, outs: tuple[int, int], spec: dict) -> W4Block:
    def lin(name: str, n: int) -> Int4Weight:
        if recipe == "W4A8":
            return unpack_marlin_qqq(sd[f"{m}{name}.weight"], sd[f"{m}{name}.s_group"], sd[f"{m}{name}.s_channel"], n)
        return unpack_marlin(sd[f"{m}{name}.weight"], sd[f"{m}{name}.scale"], n)

    scale = (lambda name: float(sd[f"{m}{name}.input_scale"])) if recipe == "W4A8" else (lambda _name: None)
    rest = {("norm:" + k[len(nrm):]) if k.startswith(nrm) else k[len(m):]: sd[k] for k in spec
            if not k[len(m):].startswith(("in_proj.", "out_proj."))}
    return W4Block(recipe, lin("in_proj", outs[0]), lin("out_proj", outs[1]), scale("in_proj"), scale("out_proj"), rest)
