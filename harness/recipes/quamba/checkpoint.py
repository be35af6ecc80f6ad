"""Quamba1 W8A8 checkpoint directories (``QuambaLMHeadModel.save_pretrained``): recognise, validate, read, write.

The layout, from enyac-group/Quamba c474646 (files under ``quamba/``) and spec notes §2.5-§2.7:

* ``config.json`` = ``json.dump(model.config.__dict__)`` (quamba_mixer_seq.py:447-449): the mamba_ssm
  MambaConfig fields plus ``ssm_cfg.layer``, ``norm_cfg.norm``, ``embedding_cfg.layer``, ``lm_head_cfg.layer``
  (modelutils_mamba.py:863-868); ``is_hybrid`` only for hybrid models (modelutils_mamba.py:899).
* ``pytorch_model.bin`` = ``torch.save(state_dict)`` (quamba_mixer_seq.py:444-445). Per block
  (``backbone.layers.{i}.``) the quantized modules store int8 buffers, fp32 buffers and, through their
  ``store_hook``, plain Python floats: see ``layer_spec``.

Scales map onto ``LayerScales`` (qMambaLayer.py:838-892): s_in = norm.output_scale, s_xz = conv1d.input_scale
(= selective_scan.z_scale), s_u = conv1d.output_scale (= u_scale), s_xp = selective_scan.B_scale (= C_scale,
dt_proj's input scale), s_dt = dt_scale, s_h = ssm_state_scale, s_H = had.x_H_scale (= out_proj.a).
"""
from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import asdict
from pathlib import Path

import torch

from ...checkpoints.loading import ModelDirError, refuse_in
from .checkpoint_checks import SUPPORTED, check_blocks_present, check_values, config_dims
from ...store.files import is_regular, read_regular
from ...kernels.quant import f32
from ...spec import LayerScales, ModelDims, QTensor
from ...architectures.mamba1.weights import LayerParams

__all__ = ["QuambaCheckpoint", "is_quamba_dir", "open_quamba", "layer_spec", "write_quamba", "pad16",
           "SUPPORTED", "LINEARS", "QUAMBA_MIXERS", "read_config", "kind_ok", "describe_kind", "linear_entries",
           "layer_entries", "PAD_VOCAB", "pad_rows"]

# quamba_mixer_seq.py:82-85 (mixers), 291 (embeddings), 413 (lm_heads)
QUAMBA_MIXERS = {"W8A8QMamba", "W4A16QMamba", "W4A8QMamba", "W8A8QMamba2", "W4A16QMamba2", "W4A8QMamba2"}
# LayerParams field -> module under mixer. (W8A8B8O8Linear, or W8A8B16O16Linear for out_proj)
LINEARS = {"in_proj": "in_proj", "x_proj": "x_proj", "dt_proj": "dt_proj", "out_proj": "out_proj"}
F, T0, T11 = "float", "fp32[]", "fp32[1,1]"  # scalar kinds: Python float, fp32 0-dim tensor, fp32 [1, 1] tensor


def pad16(n: int) -> int:
    """W8A8 linears pad their output dimension to a multiple of 16 (qLinearLayer.py:547-549, 752-754)."""
    return n + (16 - n % 16) % 16


PAD_VOCAB = 8  # MambaConfig.pad_vocab_size_multiple default; QuambaLMHeadModel pads (quamba_mixer_seq.py:371-372)


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """`t` with zero rows appended up to `rows` (the padded vocabulary of the embedding and lm_head)."""
    return torch.nn.functional.pad(t, (0, 0, 0, rows - t.shape[0])) if t.shape[0] < rows else t


def _linear_spec(prefix: str, d_in: int, d_out: int) -> dict:
    # weight: transposed view [in, out + pad] of row-major [out + pad, in] bytes (qLinearLayer.py:552-554, 573);
    # a, b: fp32 [1, 1] buffers (555-558); alpha: Python float from store_hook (560, 590-592)
    return {f"{prefix}.weight": (torch.int8, (d_in, pad16(d_out))), f"{prefix}.a": T11, f"{prefix}.b": T11,
            f"{prefix}.alpha": F}


def layer_spec(d: ModelDims, i: int, conv_bias: bool = True) -> dict:
    """key -> (dtype, shape) for tensors or a scalar kind (F, T0, T11), for block i, in state-dict order."""
    p, E = f"backbone.layers.{i}.", d.d_inner
    spec = {p + "norm.weight": (torch.float16, (d.d_model,)), p + "norm.output_scale": F}  # qNorm.py:20, 39
    spec.update(_linear_spec(p + "mixer.in_proj", d.d_model, 2 * E))
    spec[p + "mixer.conv1d.weight"] = (torch.int8, (E, d.d_conv))                        # qConvLayer.py:28-29
    if conv_bias:
        spec[p + "mixer.conv1d.bias"] = (torch.int8, (E,))                                # qConvLayer.py:31-32
    for name in ("weight_scale", "bias_scale", "input_scale", "output_scale"):            # qConvLayer.py:75-79
        spec[p + f"mixer.conv1d.{name}"] = F
    spec.update(_linear_spec(p + "mixer.x_proj", E, d.dt_rank + 2 * d.d_state))
    spec.update(_linear_spec(p + "mixer.dt_proj", d.dt_rank, E))
    s = p + "mixer.selective_scan."                                                       # qSelectiveScan.py:83-100
    spec.update({s + "dt_bias": (torch.int8, (E,)), s + "dt_bias_scale": T0, s + "A_log": (torch.int8, (E, d.d_state)),
                 s + "A_scale": T0, s + "D": (torch.int8, (E,)), s + "D_scale": T0})
    spec.update({s + n: T0 for n in ("u_scale", "dt_scale", "B_scale", "C_scale", "z_scale", "ssm_state_scale")})
    spec[p + "mixer.had.x_H_scale"] = F                                                   # qHadamard.py:18-19
    spec.update(_linear_spec(p + "mixer.out_proj", E, d.d_model))
    return spec


def _top_spec(d: ModelDims, vocab: int, embedding: str, lm_head: str) -> dict:
    spec: dict = {}
    if embedding == "W8O16Embedding":  # int8 parameter + fp16 per-row scales (qEmbedding.py:74-79)
        spec.update({"backbone.embedding.weight": (torch.int8, (vocab, d.d_model)),
                     "backbone.embedding.scales": (torch.float16, (vocab,))})
    else:
        spec["backbone.embedding.weight"] = (torch.float16, (vocab, d.d_model))
    spec["backbone.norm_f.weight"] = (torch.float16, (d.d_model,))
    if lm_head == "W8A8B16O16Linear":  # norm_f becomes a QRMSNorm (modelutils_mamba.py:658-662)
        spec["backbone.norm_f.output_scale"] = F
        spec.update(_linear_spec("lm_head", d.d_model, vocab))
    else:
        spec["lm_head.weight"] = (torch.float16, (vocab, d.d_model))
    return spec


def read_config(path: Path) -> dict | None:
    """config.json as a dict; None when it is missing or not a JSON object. A special file (a FIFO would block
    the read, /dev/zero never end it) or one over 1 MiB is a ModelDirError naming it, before it is read."""
    file = path / "config.json"
    try:
        cfg = json.loads(read_regular(file, 1 << 20, refuse_in(file)))
    except ModelDirError:
        raise
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def is_quamba_dir(path: Path | str) -> bool:
    """A config.json written by Quamba: a Quamba mixer in ssm_cfg.layer, or Quamba's extra config keys."""
    cfg = read_config(Path(path))
    if cfg is None:
        return False
    layer = (cfg.get("ssm_cfg") or {}).get("layer") if isinstance(cfg.get("ssm_cfg"), dict) else None
    return (isinstance(layer, list) or (isinstance(layer, str) and layer in QUAMBA_MIXERS) or "norm_cfg" in cfg or "lm_head_cfg" in cfg
            or bool(cfg.get("is_hybrid")))


def kind_ok(value, kind) -> bool:
    if kind == F:
        return type(value) is float
    if not isinstance(value, torch.Tensor):
        return False
    if isinstance(kind, tuple):
        return value.dtype == kind[0] and tuple(value.shape) == kind[1]
    return value.dtype == torch.float32 and tuple(value.shape) == ((1, 1) if kind == T11 else ())


def describe_kind(kind) -> str:
    if isinstance(kind, tuple):
        return f"a {str(kind[0]).removeprefix('torch.')} tensor of shape {list(kind[1])}"
    return {F: "a Python float", T0: "an fp32 0-dim tensor", T11: "an fp32 [1, 1] tensor"}[kind]


def _got(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')} tensor of shape {list(value.shape)}"
    return f"a {type(value).__name__}"


def check_spec(f: Path, sd: dict, spec: dict, context: str, ok=kind_ok, what=describe_kind) -> None:
    """Every key of ``spec`` is in ``sd`` and of its kind (``ok(value, kind)``), else ModelDirError naming the key,
    what it must be (``what(kind)``) and, for a missing key, ``context`` (what is supported)."""
    for key, kind in spec.items():
        if key not in sd:
            raise ModelDirError(f"{f}: {key!r} is missing; it must be {what(kind)} ({context})")
        if not ok(sd[key], kind):
            got = _got(sd[key]) if sd[key] is not None else "None"
            raise ModelDirError(f"{f}: {key!r} is {got}, expected {what(kind)}")


class QuambaCheckpoint:
    """A validated Quamba1 W8A8 directory; tensors are memory-mapped and read on first use."""

    format = "quamba-w8a8"
    prep = "quamba"  # the prep whose rotated int8 codes and scales it holds

    def __init__(self, path: Path, cfg: dict, sd: dict, dims: ModelDims, kinds: dict) -> None:
        self.path, self.cfg, self._sd, self.dims, self.kinds = path, cfg, sd, dims, kinds
        self.tensors_read: dict[str, int] = {}
        self._embedding: torch.Tensor | None = None

    def _get(self, key: str):
        v = self._sd[key]
        if isinstance(v, torch.Tensor):
            self.tensors_read[key] = v.numel() * v.element_size()
        return v

    def _scalar(self, key: str) -> float:
        v = self._get(key)
        return float(v) if type(v) is float else float(v.reshape(()))

    def int8_layer(self, i: int) -> LayerParams:
        """The block's given int8 codes and scales as weights.LayerParams (rotated, norm folded)."""
        p, d = f"backbone.layers.{i}.", self.dims

        def lin(name: str, d_out: int) -> QTensor:
            codes = self._get(f"{p}mixer.{name}.weight").t()[:d_out].contiguous()  # unpad, [out, in]
            return QTensor(codes, self._scalar(f"{p}mixer.{name}.b"))

        def param(name: str, scale: str) -> QTensor:
            return QTensor(self._get(p + "mixer.selective_scan." + name).contiguous(),
                           self._scalar(p + "mixer.selective_scan." + scale))

        c = p + "mixer.conv1d."
        bias = QTensor(self._get(c + "bias").contiguous(), self._scalar(c + "bias_scale")) if c + "bias" in self._sd else None
        norm = self._get(p + "norm.weight").to(torch.float32)
        return LayerParams(
            norm_weight=None if bool((norm == 1).all()) else norm,  # folded into in_proj (modelutils_mamba.py:55)
            in_proj=lin("in_proj", 2 * d.d_inner),
            conv_weight=QTensor(self._get(c + "weight").contiguous(), self._scalar(c + "weight_scale")),
            conv_bias=bias, x_proj=lin("x_proj", d.dt_rank + 2 * d.d_state), dt_proj=lin("dt_proj", d.d_inner),
            dt_bias=param("dt_bias", "dt_bias_scale"), A_log=param("A_log", "A_scale"), D=param("D", "D_scale"),
            out_proj=lin("out_proj", d.d_model))

    def layer_scales(self, i: int) -> LayerScales:
        p = f"backbone.layers.{i}."
        s = p + "mixer.selective_scan."
        return LayerScales(s_in=self._scalar(p + "norm.output_scale"), s_xz=self._scalar(p + "mixer.conv1d.input_scale"),
                           s_u=self._scalar(p + "mixer.conv1d.output_scale"), s_xp=self._scalar(s + "B_scale"),
                           s_dt=self._scalar(s + "dt_scale"), s_h=self._scalar(s + "ssm_state_scale"),
                           s_H=self._scalar(p + "mixer.had.x_H_scale"))

    def embedding(self) -> torch.Tensor:
        """(vocab, d_model) fp16 rows as the model computes them: rotated; for W8O16Embedding f16(scale * code)
        (the exact product rounded once, csrc/embedding/quant_embedding_kernel.cuh:65-78, spec notes §2.7)."""
        if self._embedding is None:
            w = self._get("backbone.embedding.weight")
            if self.kinds["embedding"] == "W8O16Embedding":
                scales = self._get("backbone.embedding.scales").to(torch.float32)
                w = (w.to(torch.float32) * scales[:, None]).to(torch.float16)  # exact in fp32, one fp16 rounding
            self._embedding = w
        return self._embedding

    def lm_head(self) -> tuple[torch.Tensor | QTensor, float | None, float | None]:
        """(weight, input scale, alpha): the fp16 (vocab, d_model) lm_head (norm_f folded and rotated,
        modelutils_mamba.py:64-70) with (None, None); or a W8A8B16O16Linear's unpadded int8 codes (vocab,
        d_model), norm_f's output scale (QRMSNorm, qNorm.py:38-39) and the stored fp32 alpha = s_w * s_in
        (qLinearLayer.py:771-784)."""
        if self.kinds["lm_head"] != "W8A8B16O16Linear":
            return self._get("lm_head.weight").to(torch.float32), None, None
        codes = self._get("lm_head.weight").t()[:self.dims.vocab_size].contiguous()
        return (QTensor(codes, self._scalar("lm_head.b")), self._scalar("backbone.norm_f.output_scale"),
                self._scalar("lm_head.alpha"))

    def stored_dtype(self) -> str:
        return "int8"

    def prefix_hashes(self, depth: int) -> list[str]:
        """sha256 chain over dims, embedding and every entry of blocks 0..i (as checkpoints.loading.Checkpoint.prefix_hashes)."""
        h = hashlib.sha256(json.dumps({"format": self.format, **asdict(self.dims)}, sort_keys=True).encode())
        h.update(self.embedding().contiguous().view(torch.uint8).numpy().data)
        out = []
        for i in range(depth + 1):
            prefix = f"backbone.layers.{i}."
            for key in sorted(k for k in self._sd if k.startswith(prefix)):
                v = self._get(key)
                h.update(key.encode())
                h.update(v.contiguous().reshape(-1).view(torch.uint8).numpy().data if isinstance(v, torch.Tensor) else repr(v).encode())
            out.append(h.copy().hexdigest())
        return out

    def read_summary(self) -> dict:
        return {"count": len(self.tensors_read), "bytes": sum(self.tensors_read.values()),
                "checkpoint_bytes": (self.path / "pytorch_model.bin").stat().st_size, "keys": sorted(self.tensors_read)}

    def info(self) -> dict:
        return {"ssm_layer": "W8A8QMamba", **self.kinds}


def parse_config(path: Path, cfg: dict, parse):
    """parse(path, cfg), a missing or mistyped field (KeyError, TypeError, ValueError) turned into a ModelDirError
    naming config.json; a ModelDirError of the parser passes as it is."""
    try:
        return parse(path, cfg)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, ModelDirError):
            raise
        raise ModelDirError(f"{path}/config.json: missing or malformed field ({type(e).__name__}: {e})") from None


def open_config(path: Path, parse) -> tuple[dict, object, dict, Path]:
    """(config, dims, kinds, the state dict's file) of a Quamba checkpoint directory: config.json read and parsed
    by ``parse(path, cfg) -> (dims, kinds)``, pytorch_model.bin present; else ModelDirError naming what is wrong."""
    cfg = read_config(path)
    if cfg is None:
        raise ModelDirError(f"{path}: config.json is missing or not a JSON object")
    dims, kinds = parse_config(path, cfg, parse)
    f = path / "pytorch_model.bin"
    if not is_regular(f, refuse_in(f)):
        raise ModelDirError(f"{path}: pytorch_model.bin is missing (a Quamba checkpoint holds config.json and pytorch_model.bin)")
    return cfg, dims, kinds, f


def load_state_dict(f: Path) -> dict:
    """The state dict of pytorch_model.bin (weights_only, memory-mapped where the format allows), or ModelDirError."""
    try:
        try:  # tensors carry the device they were saved from (spec notes §2.7)
            sd = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # legacy (non-zip) serialization cannot be memory-mapped
            sd = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated file, unpicklable content
        raise ModelDirError(f"{f}: cannot read the state dict ({type(e).__name__}: {e})") from None
    if not isinstance(sd, dict):
        raise ModelDirError(f"{f}: not a state dict")
    return sd


def open_w8a8(path: Path, parse, block_spec) -> tuple[dict, object, dict, Path, dict, dict]:
    """(config, dims, kinds, the state dict's file, the state dict, key -> kind of every entry) of a W8A8 checkpoint
    directory: config.json parsed by ``parse``, the blocks present, every block's keys by
    ``block_spec(dims, i, conv_bias)`` beside the embedding, norm_f and lm_head keys."""
    cfg, dims, kinds, f = open_config(path, parse)
    sd = load_state_dict(f)
    check_blocks_present(f, sd, dims.n_layer)
    conv_bias = "backbone.layers.0.mixer.conv1d.bias" in sd
    expected = _top_spec(dims, dims.vocab_size, kinds["embedding"], kinds["lm_head"])
    for i in range(dims.n_layer):
        expected.update(block_spec(dims, i, conv_bias))
    return cfg, dims, kinds, f, sd, expected


def open_quamba(path: Path | str) -> QuambaCheckpoint:
    """Validate config and every key, dtype, shape and scalar type (no tensor data is read), or raise ModelDirError."""
    path = Path(path)
    cfg, dims, kinds, f, sd, expected = open_w8a8(path, config_dims, layer_spec)
    check_spec(f, sd, expected, SUPPORTED)
    check_values(f, sd, expected)
    for i in range(dims.n_layer):  # scales stored twice must agree (qMambaLayer.py:848-892)
        p = f"backbone.layers.{i}.mixer."
        for a, b in (("conv1d.input_scale", "selective_scan.z_scale"), ("conv1d.output_scale", "selective_scan.u_scale"),
                     ("selective_scan.B_scale", "selective_scan.C_scale")):
            if float(sd[p + a]) != float(sd[p + b]):
                raise ModelDirError(f"{f}: {p + a} = {float(sd[p + a])} and {p + b} = {float(sd[p + b])} must be equal")
    return QuambaCheckpoint(path, cfg, sd, dims, kinds)


def linear_entries(prefix: str, w: QTensor, s_in: float, s_out: float | None) -> dict:
    """W8A8B8O8Linear.from_fp16 (qLinearLayer.py:565-587), or W8A8B16O16Linear (771-784) when s_out is None."""
    codes = w.codes
    n_out = codes.shape[0]
    padded = torch.nn.functional.pad(codes, (0, 0, 0, pad16(n_out) - n_out)).contiguous()
    s_w = torch.tensor(w.scale, dtype=torch.float32)
    if s_out is None:
        a, alpha = s_in, (s_w * s_in).item()
    else:
        a, alpha = s_in / s_out, (s_w * s_in / s_out).item()  # tensor arithmetic in fp32, then .item()
    return {prefix + ".weight": padded.t(), prefix + ".a": torch.tensor([[a]], dtype=torch.float32),
            prefix + ".b": torch.tensor([[w.scale]], dtype=torch.float32), prefix + ".alpha": alpha}


def layer_entries(i: int, p, s: LayerScales, d: ModelDims) -> dict:
    """One block's state-dict entries from int8 LayerParams p and its scales (W8A8QMamba.from_fp16)."""
    k = f"backbone.layers.{i}."
    norm = torch.ones(d.d_model, dtype=torch.float16) if p.norm_weight is None else p.norm_weight.to(torch.float16)
    out = {k + "norm.weight": norm, k + "norm.output_scale": f32(s.s_in)}
    out.update(linear_entries(k + "mixer.in_proj", p.in_proj, s.s_in, s.s_xz))
    c = k + "mixer.conv1d."
    out[c + "weight"] = p.conv_weight.codes.contiguous()
    if p.conv_bias is not None:
        out[c + "bias"] = p.conv_bias.codes.contiguous()
    out.update({c + "weight_scale": p.conv_weight.scale, c + "bias_scale": 1.0 if p.conv_bias is None else p.conv_bias.scale,
                c + "input_scale": s.s_xz, c + "output_scale": s.s_u})
    out.update(linear_entries(k + "mixer.x_proj", p.x_proj, s.s_u, s.s_xp))
    out.update(linear_entries(k + "mixer.dt_proj", p.dt_proj, s.s_xp, s.s_dt))  # dt_proj reads s_xp (qMambaLayer.py:867)
    q = k + "mixer.selective_scan."
    t = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    b_scale = t(s.s_xp)  # B_scale and C_scale are one storage (qSelectiveScan.py:131-132, spec notes §2.7)
    out.update({q + "dt_bias": p.dt_bias.codes, q + "dt_bias_scale": t(p.dt_bias.scale), q + "A_log": p.A_log.codes,
                q + "A_scale": t(p.A_log.scale), q + "D": p.D.codes, q + "D_scale": t(p.D.scale), q + "u_scale": t(s.s_u),
                q + "dt_scale": t(s.s_dt), q + "B_scale": b_scale, q + "C_scale": b_scale, q + "z_scale": t(s.s_xz),
                q + "ssm_state_scale": t(s.s_h)})
    out[k + "mixer.had.x_H_scale"] = s.s_H
    out.update(linear_entries(k + "mixer.out_proj", p.out_proj, s.s_H, None))
    return out


def write_quamba(out_dir: Path, dims: ModelDims, config: dict, layers: list, scales: list[LayerScales],
                 *, embedding: dict, lm_head: torch.Tensor | QTensor, lm_head_input_scale: float | None = None) -> None:
    """Write config.json and pytorch_model.bin into out_dir (which the caller renames into place).

    layers: int8 LayerParams per block (rotated); embedding: {"backbone.embedding.weight": ..., [scales]};
    lm_head: fp16 (vocab, d_model), norm_f folded and rotated (modelutils_mamba.py:64-70), or its int8
    codes, stored as a W8A8B16O16Linear whose input (norm_f's output) scale is lm_head_input_scale
    (modelutils_mamba.py:658-662).
    """
    sd: OrderedDict = OrderedDict(embedding)
    for i, (p, s) in enumerate(zip(layers, scales)):
        sd.update(layer_entries(i, p, s, dims))
    sd["backbone.norm_f.weight"] = torch.ones(dims.d_model, dtype=torch.float16)  # folded (modelutils_mamba.py:69)
    if isinstance(lm_head, QTensor):
        assert lm_head_input_scale is not None, "a quantized lm_head needs its input scale"
        sd["backbone.norm_f.output_scale"] = lm_head_input_scale  # QRMSNorm.store_hook (qNorm.py:38-39)
        sd.update(linear_entries("lm_head", lm_head, lm_head_input_scale, None))
    else:
        sd["lm_head.weight"] = lm_head.to(torch.float16)
    torch.save(sd, out_dir / "pytorch_model.bin")
    (out_dir / "config.json").write_text(json.dumps(config, indent=4))
