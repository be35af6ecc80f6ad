"""Quamba2 W8A8 checkpoint directories (``QuambaLMHeadModel.save_pretrained`` of a ``W8A8QMamba2`` model):
recognise, validate, read into what the q2-w8a8 block runs on, write.

enyac-group/Quamba c474646: ``config.json`` = the model's MambaConfig ``__dict__`` with ``ssm_cfg.layer``,
``norm_cfg``, ``embedding_cfg``, ``lm_head_cfg`` and ``tie_embeddings: false`` (modelutils_mamba.py:853-873,
quamba_mixer_seq.py:447-449); ``pytorch_model.bin`` = ``torch.save(state_dict)`` (quamba_mixer_seq.py:444-445).
The block keys and their checks: recipes.quamba.q2.checkpoint_checks. The embedding, norm_f and lm_head keys are
Quamba1's (recipes.quamba.checkpoint), so their reading is inherited.

What the stored tensors become (``Q2Scales`` and ``Q2Params`` of recipes.quamba.q2.params, the values the calibration
path computes): s_in = norm.output_scale (= in_proj.a), s_z = mixer.norm.z_scale, s_x/s_B/s_C = conv1d.x_scale,
B_scale, C_scale (the conv's input scales, qConvLayer.py:208-210), s_dt = qchunk_scan.dt_scale, x_table =
conv1d.x_out_scales, B_scales/C_scales = conv1d.B_out_scales/C_out_scales, s_H = had.x_H_scale (= out_proj.a);
the head and dim group sizes are the differences of the stored cumulative ranges. The weights are stored
already reordered, so the channel and head order is the checkpoint's own (identity) unless a float model is
attached: then it is recovered by matching (recipes.quamba.q2.order) and the taps come in the float model's order.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import torch

from ..checkpoint import QuambaCheckpoint, check_spec, describe_kind, kind_ok, open_w8a8, pad16
from .checkpoint_checks import NONE, SUPPORTED2, check_q2_values, q2_config_dims, q2_layer_spec
from ..checkpoint_checks import check_values
from .grouping import GroupReorder
from ....kernels.conv1d_grouped import conv_out_scales, x_channel_scales
from .params import Q2Params, Q2Scales
from ....architectures.mamba2.weights import Mamba2Params
from ....spec import Mamba2Dims, QTensor

__all__ = ["Quamba2Checkpoint", "is_quamba2_config", "open_quamba2", "q2_state_dict",
           "write_quamba2"]


def is_quamba2_config(cfg: dict) -> bool:
    """A Quamba config whose mixer is a Mamba-2 one (``*QMamba2``) or a hybrid W4AX one (Mamba-2 only)."""
    ssm = cfg.get("ssm_cfg") if isinstance(cfg.get("ssm_cfg"), dict) else {}
    layer = ssm.get("layer")
    return bool(cfg.get("is_hybrid")) or isinstance(layer, list) or (isinstance(layer, str) and layer.endswith("QMamba2"))


def _ok(value, kind) -> bool:
    return value is None if kind == NONE else kind_ok(value, kind)


def _what(kind) -> str:
    return "None (QRMSNormGated's fp16 output)" if kind == NONE else describe_kind(kind)


class Quamba2Checkpoint(QuambaCheckpoint):
    """A validated Quamba2 W8A8 directory; tensors are memory-mapped and read on first use."""

    format = "quamba2-w8a8"
    prep = "quamba2"

    def __init__(self, path: Path, cfg: dict, sd: dict, dims: Mamba2Dims, kinds: dict) -> None:
        super().__init__(path, cfg, sd, dims, kinds)
        self.orders: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (channel_index, head_index)
        self.order_source = None  # a callable layer -> (channel_index, head_index), set by attach_float

    def attach_float(self, float_ckpt) -> None:
        """Take the channel and head order of each block from the float model it was made from (quamba2_order)."""
        from .order import recover_order

        def source(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            channels, heads, summary = recover_order(self.in_proj_codes(i), float_ckpt.raw_layer(i), self.dims)
            self.order_summary[i] = summary
            return channels, heads

        self.order_source, self.order_summary = source, {}

    def in_proj_codes(self, i: int) -> torch.Tensor:
        """in_proj's unpadded int8 codes (n, d_model) [z | x | B | C | dt]."""
        d = self.dims
        return self._m(i, "in_proj.weight").t()[:2 * d.d_inner + 2 * d.ngroups * d.d_state + d.nheads].contiguous()

    def _m(self, i: int, key: str):
        return self._get(f"backbone.layers.{i}.mixer.{key}")

    def reorder(self, i: int) -> GroupReorder:
        """The block's groups (sizes from the stored ranges) and its channel/head order (module docstring)."""
        if i not in self.orders:
            d = self.dims
            self.orders[i] = self.order_source(i) if self.order_source is not None else \
                (torch.arange(d.d_inner), torch.arange(d.nheads))
        heads = self._m(i, "conv1d.x_head_group_range").to(torch.int32)
        dims = self._m(i, "conv1d.x_dim_group_range").to(torch.int32)
        diff = lambda t: torch.diff(t, dim=-1, prepend=torch.zeros_like(t[..., :1]))  # noqa: E731
        return GroupReorder(*self.orders[i], diff(heads), diff(dims))

    def layer_scales(self, i: int) -> Q2Scales:
        c = "conv1d."
        return Q2Scales(s_in=self._scalar(f"backbone.layers.{i}.norm.output_scale"),
                        s_z=self._scalar(f"backbone.layers.{i}.mixer.norm.z_scale"),
                        s_x=self._scalar(f"backbone.layers.{i}.mixer.{c}x_scale"),
                        s_B=self._scalar(f"backbone.layers.{i}.mixer.{c}B_scale"),
                        s_C=self._scalar(f"backbone.layers.{i}.mixer.{c}C_scale"),
                        s_dt=self._scalar(f"backbone.layers.{i}.mixer.qchunk_scan.dt_scale"),
                        x_table=self._m(i, c + "x_out_scales").to(torch.float32).clone(),
                        B_scales=self._m(i, c + "B_out_scales").to(torch.float32).clone(),
                        C_scales=self._m(i, c + "C_out_scales").to(torch.float32).clone(),
                        s_H=self._scalar(f"backbone.layers.{i}.mixer.had.x_H_scale"), reorder=self.reorder(i),
                        ssm_state_scale=self._m(i, "qchunk_scan.ssm_state_scale").to(torch.float32).clone())

    def q2_params(self, i: int) -> Q2Params:
        """The stored codes and scales as recipes.quamba.q2.params.Q2Params (in the checkpoint's channel order)."""
        d, m = self.dims, f"backbone.layers.{i}.mixer."
        in_codes = self.in_proj_codes(i)
        n = in_codes.shape[0]
        in_b = self._m(i, "in_proj.b")[0, :n].to(torch.float32).clone()
        has_bias = m + "conv1d.bias" in self._sd
        split = lambda k: tuple(self._scalar(f"{m}conv1d.{k}{s}_scale") for s in "xBC")  # noqa: E731
        conv = (self._m(i, "conv1d.weight").contiguous(), split("w"),
                self._m(i, "conv1d.bias").contiguous() if has_bias else None, split("b") if has_bias else None)
        s = Quamba2Checkpoint.layer_scales(self, i)  # the W8A8 scales (a W4A8 checkpoint's layer_scales wraps them)
        head_range, dim_range = self._m(i, "conv1d.x_head_group_range"), self._m(i, "conv1d.x_dim_group_range")
        x_scales = x_channel_scales(s.x_table, head_range, dim_range, x_dim=d.d_inner, headdim=d.headdim)
        q = "qchunk_scan."
        A_log = QTensor(self._m(i, q + "A_log").contiguous(), self._scalar(m + q + "A_log_scale"))
        D = QTensor(self._m(i, q + "D").contiguous(), self._scalar(m + q + "D_scale"))
        out_proj = QTensor(self._m(i, "out_proj.weight").t()[:d.d_model].contiguous(), self._scalar(m + "out_proj.b"))
        deq = lambda t: t.codes.to(torch.float32) * t.scale  # noqa: E731
        fp16 = Mamba2Params(  # the block reads dt_bias and gnorm_weight; the rest are the codes' real values
            norm_weight=None, in_proj=in_codes.to(torch.float32), conv_weight=conv[0].to(torch.float32),
            conv_bias=None if conv[2] is None else conv[2].to(torch.float32),
            dt_bias=self._m(i, q + "dt_bias").to(torch.float32).clone(), A_log=deq(A_log), D=deq(D),
            gnorm_weight=self._m(i, "norm.weight").to(torch.float32).clone(), out_proj=deq(out_proj))
        return Q2Params(fp16=fp16, in_proj=in_codes, in_proj_b=in_b, conv=conv, x_scales=x_scales,
                        conv_out=conv_out_scales(x_scales, s.B_scales, s.C_scales, d.d_state), A_log=A_log, D=D,
                        out_proj=out_proj)

    def int8_layer(self, i: int):
        raise NotImplementedError("a Quamba2 checkpoint gives Q2Params (q2_params), not Mamba-1 LayerParams")

    def info(self) -> dict:
        return {"ssm_layer": "W8A8QMamba2", **self.kinds,
                "channel_order": "recovered from the float model" if self.order_source else "the checkpoint's own"}


def open_quamba2(path: Path | str) -> Quamba2Checkpoint:
    """Validate config and every key, dtype, shape, scalar type and scale (tensor data of the scales and ranges
    is read; the weights are not), or raise ModelDirError naming the key and what is valid."""
    path = Path(path)
    cfg, dims, kinds, f, sd, expected = open_w8a8(path, q2_config_dims, q2_layer_spec)
    check_spec(f, sd, expected, SUPPORTED2, _ok, _what)
    check_values(f, sd, {k: v for k, v in expected.items() if v != NONE})
    for i in range(dims.n_layer):
        check_q2_values(f, sd, dims, i)
    return Quamba2Checkpoint(path, cfg, sd, dims, kinds)


def _linear(prefix: str, codes: torch.Tensor, a: float, b: torch.Tensor | float, alpha: float | None) -> dict:
    """A W8A8 linear's entries: codes padded to pad16 rows and stored as the transposed view (qLinearLayer.py:
    696-706, 773-778); a and b fp32 (b per column for W8A8B8O8LinearParallel, its padding 0, :701-711)."""
    n = codes.shape[0]
    padded = torch.nn.functional.pad(codes, (0, 0, 0, pad16(n) - n)).contiguous()
    out = {prefix + ".weight": padded.t(), prefix + ".a": torch.tensor([[a]], dtype=torch.float32)}
    if isinstance(b, torch.Tensor):
        out[prefix + ".b"] = torch.nn.functional.pad(b.to(torch.float32), (0, pad16(n) - n))[None].contiguous()
    else:
        out[prefix + ".b"] = torch.tensor([[b]], dtype=torch.float32)
    if alpha is not None:
        out[prefix + ".alpha"] = alpha
    return out


def q2_state_dict(i: int, p: Q2Params, s: Q2Scales, ssm_state_scale: torch.Tensor) -> dict:
    """Block i's entries of W8A8QMamba2.from_fp16 (qMamba2.py:1163-1257) from what the q2-w8a8 block runs on."""
    from .grouping import group_ranges

    k, m = f"backbone.layers.{i}.", f"backbone.layers.{i}.mixer."
    t = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    head_range, dim_range = group_ranges(s.reorder)
    x_table = s.x_table.to(torch.float32).contiguous()
    B, C = s.B_scales.to(torch.float32).contiguous(), s.C_scales.to(torch.float32).contiguous()
    sd = {k + "norm.weight": torch.ones(p.fp16.in_proj.shape[1], dtype=torch.float16),  # folded (modelutils_mamba.py:55)
          k + "norm.output_scale": s.s_in}
    sd.update(_linear(m + "in_proj", p.in_proj, s.s_in, p.in_proj_b, None))
    w_codes, w_scales, b_codes, b_scales = p.conv
    c = m + "conv1d."
    sd.update({c + "weight": w_codes.contiguous()})
    if b_codes is not None:
        sd[c + "bias"] = b_codes.contiguous()
    sd.update({c + "x_head_group_range": head_range, c + "x_dim_group_range": dim_range, c + "x_out_scales": x_table,
               c + "B_out_scales": B, c + "C_out_scales": C, c + "x_scale": s.s_x, c + "B_scale": s.s_B,
               c + "C_scale": s.s_C})
    sd.update({c + f"w{n}_scale": v for n, v in zip("xBC", w_scales)})
    if b_codes is not None:
        sd.update({c + f"b{n}_scale": v for n, v in zip("xBC", b_scales)})
    q = m + "qchunk_scan."
    sd.update({q + "dt_bias": p.fp16.dt_bias.to(torch.float16), q + "A_log": p.A_log.codes.contiguous(),
               q + "A_log_scale": t(p.A_log.scale), q + "D": p.D.codes.contiguous(), q + "D_scale": t(p.D.scale),
               q + "dt_scale": t(s.s_dt), q + "ssm_state_scale": ssm_state_scale.to(torch.float32).contiguous(),
               q + "x_scales": x_table, q + "x_head_group_range": head_range, q + "x_dim_group_range": dim_range,
               q + "B_scale": B, q + "C_scale": C})
    sd.update({m + "norm.weight": p.fp16.gnorm_weight.to(torch.float16), m + "norm.z_scale": s.s_z,
               m + "norm.output_scale": None, m + "had.x_H_scale": s.s_H})
    alpha = (t(p.out_proj.scale) * s.s_H).item()  # (weight_scale * input_scale).item() in fp32 (qLinearLayer.py:784)
    sd.update(_linear(m + "out_proj", p.out_proj.codes, s.s_H, p.out_proj.scale, alpha))
    return sd


def write_quamba2(out_dir: Path, config: dict, blocks: list[dict], *, embedding: dict, lm_head,
                  lm_head_input_scale: float | None = None, d_model: int) -> None:
    """config.json and pytorch_model.bin into out_dir (the caller renames it into place); blocks: q2_state_dict
    of each block; embedding and lm_head as recipes.quamba.checkpoint.write_quamba takes them."""
    from ..checkpoint import linear_entries

    sd: OrderedDict = OrderedDict(embedding)
    for block in blocks:
        sd.update(block)
    sd["backbone.norm_f.weight"] = torch.ones(d_model, dtype=torch.float16)  # folded (modelutils_mamba.py:93-95)
    if isinstance(lm_head, QTensor):
        assert lm_head_input_scale is not None, "a quantized lm_head needs its input scale"
        sd["backbone.norm_f.output_scale"] = lm_head_input_scale
        sd.update(linear_entries("lm_head", lm_head, lm_head_input_scale, None))
    else:
        sd["lm_head.weight"] = lm_head.to(torch.float16)
    torch.save(sd, out_dir / "pytorch_model.bin")
    (out_dir / "config.json").write_text(json.dumps(config, indent=4))
