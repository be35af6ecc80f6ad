"""Quamba2's W4A8 and W4A16 checkpoints of a Mamba-1 model: recognise, validate every key, read into what the
q2-w4a8 / q2-w4a16 modes run on a Mamba-1 model (recipes.quamba.w4.block_mamba1), with no calibration and no GPTQ.

enyac-group/Quamba c474646. ``quantize_fp16_model`` (quamba/modelutils_mamba.py:579-667) replaces each Mamba-1
block's norm and mixer and ``save_pretrained`` writes ``config.json`` with ``ssm_cfg.layer`` the mixer's class,
``norm_cfg.norm`` the norm's (modelutils_mamba.py:853-873) and ``pytorch_model.bin`` = ``torch.save(state_dict)``
(quamba_mixer_seq.py:444-449). Per block (``backbone.layers.{i}.``):

* ``W4A8QMamba`` (qMambaLayer.py:512-645), norm ``QRMSNorm`` (weight, output_scale, modelutils_mamba.py:516-520):
  W8A8QMamba's keys (recipes.quamba.checkpoint.layer_spec: QCausalConv1D, the W8A8B8O8Linear dt_proj, QSScan,
  QHadamard) with in_proj and x_proj ``W4A8B8O8Linear`` and out_proj ``W4A8B16O16Linear`` (qLinearLayer.py:139-170,
  279-311): ``workspace`` int32, ``weight`` int32 [K/16, 2N], ``input_scale`` fp32 [], ``s_channel`` fp32 [1, N],
  ``s_group`` fp16 [K/128, N], N the out-features padded to 64 (x_proj's dt_rank + 2 d_state too); in_proj's and
  x_proj's ``s_channel`` have their output scale divided in (marlin_utils.py:254-256).
* ``W4A16QMamba`` (qMambaLayer.py:230-368), norm the fp16 ``RMSNorm`` (weight; the W4A16 norm is not replaced,
  modelutils_mamba.py:569): in_proj, x_proj, out_proj ``W4A16B16O16Linear`` (qLinearLayer.py:13-38: workspace,
  weight, ``scale`` fp16 [K/128, N], N padded to 256), the fp16 model's ``conv1d.weight`` [E, 1, K] and bias,
  ``dt_proj.weight`` [E, dt_rank] (no bias), the ``dt_proj_bias`` buffer, ``A_log``, ``D`` (:345-368, any float
  dtype: MambaSimple holds dt_proj_bias as fp32, qMambaLayer.py:63); ``Hadamard`` holds no state (qHadamard.py:41-47).

The embedding and lm_head: fp16 ``Embedding`` and ``Linear`` (read as Quamba1's), or Quamba's W4O16Embedding and
the recipe's W4 lm_head (modelutils_mamba.py:590, 652, 657), checked and read by recipes.quamba.w4.checkpoint_head.
Marlin's int4 packing groups 128 in-features; a linear of 128 or fewer in-features is packed per channel (qLinearLayer.py:46, 319,
marlin_utils.py:193-214, 233), which the harness does not unpack: d_model and d_inner must be multiples of 128
above 128.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ....checkpoints.loading import ModelDirError
from ..checkpoint import QuambaCheckpoint, check_spec, layer_spec, parse_config
from .checkpoint_blocks import FLOAT, check_marlin, marlin_spec, w4_kind_ok, w4_describe_kind, load_w4
from ..checkpoint_checks import config_field, layer_kind, check_blocks_present, check_values, mamba1_sizes
from .checkpoint_head import W4HeadMixin, check_w4_top, w4_head_kinds
from .block_mamba1 import Q1W4Layer
from ....kernels.int4 import Int4Weight
from ....kernels.marlin import unpack_marlin, unpack_marlin_qqq
from ....architectures.mamba1.weights import LayerParams
from ....spec import ModelDims, QTensor

__all__ = ["Quamba1W4Checkpoint", "is_mamba1_w4_config", "open_quamba1_w4", "m1w4_block_spec", "SUPPORTED_M1W4"]

MIXERS = {"W4A8QMamba": "W4A8", "W4A16QMamba": "W4A16"}
_NORM = {"W4A8": "QRMSNorm", "W4A16": "RMSNorm"}  # modelutils_mamba.py:516-572
SUPPORTED_M1W4 = ("Quamba2 W4 Mamba-1 checkpoints: ssm_cfg.layer W4A8QMamba (norm_cfg.norm QRMSNorm) or W4A16QMamba "
                  "(RMSNorm), embedding_cfg.layer Embedding or W4O16Embedding, lm_head_cfg.layer Linear or the "
                  "recipe's W4A8B16O16Linear / W4A16B16O16Linear, d_model and d_inner multiples of 128 above 128")
_LINEARS = ("in_proj", "x_proj", "out_proj")
# scales W4A8QMamba.from_fp16 stores twice from one calibrated value (qMambaLayer.py:593-645, qSelectiveScan.py:131-132)
_SAME = (("mixer.conv1d.input_scale", "mixer.selective_scan.z_scale"),
         ("mixer.conv1d.output_scale", "mixer.selective_scan.u_scale"),
         ("mixer.selective_scan.B_scale", "mixer.selective_scan.C_scale"),
         ("norm.output_scale", "mixer.in_proj.input_scale"), ("mixer.conv1d.output_scale", "mixer.x_proj.input_scale"),
         ("mixer.had.x_H_scale", "mixer.out_proj.input_scale"))


def is_mamba1_w4_config(cfg: dict) -> bool:
    ssm = cfg.get("ssm_cfg") if isinstance(cfg.get("ssm_cfg"), dict) else {}
    layer = ssm.get("layer")
    return not cfg.get("is_hybrid") and isinstance(layer, str) and layer in MIXERS


def _refuse(path: Path | None, what: str) -> ModelDirError:
    return ModelDirError(f"{path}: {what} is not supported; supported: {SUPPORTED_M1W4}")


def m1w4_config(path: Path, cfg: dict) -> tuple[ModelDims, str, dict]:
    """(dims, recipe "W4A8" or "W4A16", the embedding and lm_head kinds) of a config.json, every field checked."""
    ssm = config_field(path, cfg, "ssm_cfg", "a table", {})
    layer = ssm["layer"]
    recipe = MIXERS[layer]
    norm = layer_kind(path, cfg, "norm", "norm_cfg", _NORM[recipe])
    if norm != _NORM[recipe]:
        raise _refuse(path, f"norm_cfg.norm {norm!r} with {layer}")
    kinds = w4_head_kinds(path, cfg, recipe, _refuse)
    dims = mamba1_sizes(path, cfg, ssm, _refuse)
    for name, k in (("d_model", dims.d_model), ("d_inner (expand * d_model)", dims.d_inner)):
        if k % 128 or k <= 128:
            raise _refuse(path, f"{name} {k} (Marlin packs a linear of 128 or fewer in-features per channel, "
                                f"qLinearLayer.py:46, 319, and needs multiples of 128 above it)")
    return dims, recipe, kinds


def m1w4_block_spec(d: ModelDims, i: int, recipe: str, conv_bias: bool = True) -> dict:
    """key -> kind for block i (module docstring); FLOAT tensors as (FLOAT, shape)."""
    p, m, E = f"backbone.layers.{i}.", f"backbone.layers.{i}.mixer.", d.d_inner
    w4a8 = recipe == "W4A8"
    if w4a8:  # W8A8QMamba's keys but the three Marlin-QQQ linears
        spec = {k: v for k, v in layer_spec(d, i, conv_bias).items() if not k[len(m):].startswith(
            tuple(n + "." for n in _LINEARS))}
    else:  # the fp16 model's tensors (qMambaLayer.py:345-368)
        spec = {p + "norm.weight": (torch.float16, (d.d_model,)), m + "conv1d.weight": (FLOAT, (E, 1, d.d_conv)),
                m + "dt_proj.weight": (FLOAT, (E, d.dt_rank)), m + "dt_proj_bias": (FLOAT, (E,)),
                m + "A_log": (FLOAT, (E, d.d_state)), m + "D": (FLOAT, (E,))}
        if conv_bias:
            spec[m + "conv1d.bias"] = (FLOAT, (E,))
    for name, k, n in zip(_LINEARS, (d.d_model, E, E), (2 * E, d.dt_rank + 2 * d.d_state, d.d_model)):
        spec.update(marlin_spec(m, name, k, n, w4a8))
    return spec


class Quamba1W4Checkpoint(W4HeadMixin, QuambaCheckpoint):
    """A validated W4A8QMamba or W4A16QMamba directory (module docstring): prep=quamba (Quamba2 prepares a Mamba-1
    model as Quamba1 does, modes.ModeRecipe.on_architecture), ``weights`` "int4", ``calibration_key`` the
    calibration of the q2-w4a8 or q2-w4a16 mode it replaces."""

    weights = "int4"

    def __init__(self, path: Path, cfg: dict, sd: dict, dims: ModelDims, kinds: dict, recipe: str) -> None:
        super().__init__(path, cfg, sd, dims, kinds)
        self.recipe = recipe
        self.format = self.calibration_key = f"quamba2-{recipe.lower()}"

    def _linear(self, i: int, name: str, out_features: int) -> Int4Weight:
        m = f"backbone.layers.{i}.mixer.{name}."
        if self.recipe == "W4A8":
            return unpack_marlin_qqq(self._get(m + "weight"), self._get(m + "s_group"), self._get(m + "s_channel"),
                                     out_features)
        return unpack_marlin(self._get(m + "weight"), self._get(m + "scale"), out_features)

    def layer_scales(self, i: int) -> Q1W4Layer:
        """The unpacked Marlin(-QQQ) linears (in_proj's and x_proj's channel scales hold their output scale divided
        in, as recipes.quamba.w4.block_mamba1.q1w4_layer fuses it) and, for W4A8, mode 0's scales (QuambaCheckpoint's keys)."""
        d = self.dims
        w8a8 = QuambaCheckpoint.layer_scales(self, i) if self.recipe == "W4A8" else None
        return Q1W4Layer(self._linear(i, "in_proj", 2 * d.d_inner),
                         self._linear(i, "x_proj", d.dt_rank + 2 * d.d_state),
                         self._linear(i, "out_proj", d.d_model), w8a8)

    def q2_params(self, i: int) -> LayerParams:
        """The block's other tensors as the build takes them (build.build_q2w4_mamba1_block): W4A8 mode 0's int8
        LayerParams, W4A16 the fp16 ones; in_proj, x_proj and out_proj are placeholders (the block runs the
        Marlin linears of layer_scales)."""
        d, p = self.dims, f"backbone.layers.{i}."
        m = p + "mixer."
        norm = self._get(p + "norm.weight").to(torch.float32)
        norm_weight = None if bool((norm == 1).all()) else norm  # folded into in_proj (modelutils_mamba.py:55)
        shapes = {"in_proj": (2 * d.d_inner, d.d_model), "x_proj": (d.dt_rank + 2 * d.d_state, d.d_inner),
                  "out_proj": (d.d_model, d.d_inner)}
        if self.recipe == "W4A16":
            f32 = lambda k: self._get(m + k).to(torch.float32).clone()  # noqa: E731
            return LayerParams(
                norm_weight=norm_weight, conv_weight=f32("conv1d.weight")[:, 0],
                conv_bias=f32("conv1d.bias") if m + "conv1d.bias" in self._sd else None, dt_proj=f32("dt_proj.weight"),
                dt_bias=f32("dt_proj_bias"), A_log=f32("A_log"), D=f32("D"),
                **{k: torch.zeros(s) for k, s in shapes.items()})
        c, s = m + "conv1d.", m + "selective_scan."
        q = lambda key, scale: QTensor(self._get(key).contiguous(), self._scalar(scale))  # noqa: E731
        return LayerParams(
            norm_weight=norm_weight, conv_weight=q(c + "weight", c + "weight_scale"),
            conv_bias=q(c + "bias", c + "bias_scale") if c + "bias" in self._sd else None,
            dt_proj=QTensor(self._get(m + "dt_proj.weight").t()[:d.d_inner].contiguous(),  # unpad, [out, in]
                            self._scalar(m + "dt_proj.b")),
            dt_bias=q(s + "dt_bias", s + "dt_bias_scale"), A_log=q(s + "A_log", s + "A_scale"),
            D=q(s + "D", s + "D_scale"),
            **{k: QTensor(torch.zeros(sh, dtype=torch.int8), 1.0) for k, sh in shapes.items()})

    def int8_layer(self, i: int) -> LayerParams:
        raise NotImplementedError("a Quamba2 W4 Mamba-1 checkpoint gives its blocks through q2_params and layer_scales")

    def info(self) -> dict:
        return {"ssm_layer": f"{self.recipe}QMamba", **self.kinds,
                "int4": "Marlin" + ("-QQQ" if self.recipe == "W4A8" else "") + " unpacked (kernels.marlin)"}


def open_quamba1_w4(path: Path | str) -> Quamba1W4Checkpoint:
    """Validate config and every key's dtype and shape, every scale and float tensor by value, or raise
    ModelDirError naming the field or key and what is valid."""
    path = Path(path)
    cfg, sd, f = load_w4(path)
    dims, recipe, kinds = parse_config(path, cfg, m1w4_config)
    check_blocks_present(f, sd, dims.n_layer)
    conv_bias = "backbone.layers.0.mixer.conv1d.bias" in sd
    check_w4_top(path, f, sd, dims, kinds, recipe, SUPPORTED_M1W4)
    w4a8 = recipe == "W4A8"
    for i in range(dims.n_layer):
        spec = m1w4_block_spec(dims, i, recipe, conv_bias)
        check_spec(f, sd, spec, f"a {recipe}QMamba block; {SUPPORTED_M1W4}", w4_kind_ok, w4_describe_kind)
        check_values(f, sd, spec)
        m = f"backbone.layers.{i}.mixer."
        for name, n in zip(_LINEARS, (2 * dims.d_inner, dims.dt_rank + 2 * dims.d_state, dims.d_model)):
            check_marlin(f, sd, m, name, n, w4a8)
        for a, b in _SAME if w4a8 else ():
            a, b = f"backbone.layers.{i}.{a}", f"backbone.layers.{i}.{b}"
            if float(sd[a]) != float(sd[b]):
                raise ModelDirError(f"{f}: {a} = {float(sd[a])} and {b} = {float(sd[b])} must be equal "
                                    f"(W4A8QMamba.from_fp16 stores one calibrated scale in both, "
                                    f"qMambaLayer.py:593-645)")
    return Quamba1W4Checkpoint(path, cfg, sd, dims, kinds, recipe)
