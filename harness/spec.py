"""Names, dtypes and small value types shared by every layer of the harness.

Dimension glossary (used in every docstring as ``name: (dims) dtype``):

    batch    sequences in a forward
    seqlen   tokens per sequence
    d_model  width of the residual stream (768 for mamba-130m)
    d_inner  width of the mixer, expand * d_model (1536)
    d_state  SSM state size N (16)
    d_conv   causal conv kernel width K (4)
    dt_rank  rank of the time-step projection R (ceil(d_model / 16) = 48)

Activations travel between the emulated ops as an ``Act``: either a plain fp32
tensor (holding fp16-representable values when the mode's ``act_dtype`` is fp16)
or a ``QTensor`` (int8 codes and one per-tensor fp32 scale; real value = code * scale).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar, Union

import torch

__all__ = [
    "SplitOut",
    "FLOAT_DTYPES",
    "INT8_BOUNDS",
    "Rounding",
    "QTensor",
    "ChannelQTensor",
    "Act",
    "QuantOut",
    "FloatOut",
    "FormatOut",
    "FORMAT_NAMES",
    "OutSpec",
    "ModelDims",
    "FalconMambaDims",
    "Mamba2Dims",
    "HybridDims",
    "NemotronHDims",
    "LayerScales",
    "SCALE_NAMES",
    "HookPoint",
]

# knob value ("fp32", "fp16") -> float dtype, for the weights and act_dtype knobs
FLOAT_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16}

# qmin/qmax of every integer format the harness emulates (symmetric int8 only).
INT8_BOUNDS: tuple[int, int] = (-128, 127)


class Rounding(str, enum.Enum):
    """Tie rule of a float -> integer conversion.

    HALF_EVEN: 2.5 -> 2, 3.5 -> 4, -2.5 -> -2 (torch.round, PTX cvt.rni, Triton rint).
    HALF_AWAY: 2.5 -> 3, -2.5 -> -3 (C roundf).
    """

    HALF_EVEN = "half_even"
    HALF_AWAY = "half_away"


@dataclass
class QTensor:
    """Per-tensor symmetric int8 activation or weight.

    codes: (any) int8, in [-128, 127]
    scale: fp32-representable Python float; real value = codes * scale
    n_clipped: how many values fell outside [-128, 127] before saturation
        (None where unknown, e.g. a slice of a larger quantized tensor)
    """

    codes: torch.Tensor
    scale: float
    n_clipped: int | None = None

    def __post_init__(self) -> None:
        assert self.codes.dtype == torch.int8, f"QTensor codes must be int8, got {self.codes.dtype}"

    def dequantize(self) -> torch.Tensor:
        """(q - 0) * scale in fp32, as every kernel's dequantization does."""
        return self.codes.to(torch.float32) * torch.tensor(self.scale, dtype=torch.float32)

    def split(self, sizes: list[int], dim: int = -1) -> list["QTensor"]:
        return [QTensor(c, self.scale) for c in torch.split(self.codes, sizes, dim=dim)]

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape


@dataclass(frozen=True)
class ChannelQTensor:
    """int8 codes with one scale per channel (the last dim): a tap of Quamba2's multi-scale activations (in_proj's
    xBC by section, the conv's x by head/dim group, B and C by SSD group), as the capture records it.

    codes: (..., n) int8; scales: (n,) fp32; real value = codes * scales
    """

    codes: torch.Tensor
    scales: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        return self.codes.to(torch.float32) * self.scales.to(torch.float32)

    def scale_summary(self) -> dict:
        """What the stats record of the scales (metrics.errors.tensor_stats): their count, distinct values, range."""
        s = self.scales.to(torch.float32)
        return {"per": "channel", "channels": int(s.numel()), "distinct": int(torch.unique(s).numel()),
                "min": float(s.min()), "max": float(s.max())}


Act = Union[torch.Tensor, QTensor]


@dataclass(frozen=True)
class QuantOut:
    """An op's output is quantized: sat8(round(v / scale)) with the given tie rule."""

    scale: float
    rounding: Rounding


@dataclass(frozen=True)
class FloatOut:
    """An op's output stays floating point, rounded to ``dtype`` (fp32 or fp16)."""

    dtype: torch.dtype

    def __post_init__(self) -> None:
        assert self.dtype in (torch.float32, torch.float16), f"unsupported float dtype {self.dtype}"


# The number formats of harness.formats (../shared/reference/formats.md), named here so that the recipes
# (rank 0) can offer them as knob values; harness.kernels.formats implements exactly these.
FORMAT_NAMES: tuple[str, ...] = (
    "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp4_e2m1",
    "nvfp4", "nvfp4_noglobal", "hifp8", "int8", "int8_g128", "int4_g128",
)


@dataclass(frozen=True)
class FormatOut:
    """An op's output is fake-quantized in number format ``fmt`` (harness.formats): fp32 values on its grid."""

    fmt: str

    def __post_init__(self) -> None:
        assert self.fmt in FORMAT_NAMES, f"unknown number format {self.fmt!r}"


@dataclass(frozen=True)
class SplitOut:
    """An op's output split along its last dimension, each part stored by its own float or format rule (a Mamba-2
    in_proj's z | xBC | dt, its conv's x | B | C under a number format: each part on its own groups)."""

    widths: tuple[int, ...]
    outs: tuple[Union[FloatOut, FormatOut], ...]

    def __post_init__(self) -> None:
        assert len(self.widths) == len(self.outs), "one output rule per part"


OutSpec = Union[QuantOut, FloatOut, FormatOut, SplitOut]


@dataclass(frozen=True)
class ModelDims:
    """Sizes of a Mamba-1 model, read once from its config and checked against its tensors."""

    architecture: ClassVar[str] = "mamba1"  # what build and the site tables dispatch on (not in asdict)
    d_model: int
    d_inner: int
    d_state: int
    d_conv: int
    dt_rank: int
    n_layer: int
    vocab_size: int
    norm_eps: float


@dataclass(frozen=True)
class FalconMambaDims(ModelDims):
    """Sizes of a Falcon-Mamba model: a Mamba-1 whose dt, B and C (x_proj's output parts) pass a weightless RMSNorm
    of epsilon ``mixer_rms_eps`` before dt_proj and the scan (transformers 5.23
    models/falcon_mamba/modeling_falcon_mamba.py:350-352, 466-469)."""

    architecture: ClassVar[str] = "falcon_mamba"
    mixer_rms_eps: float = 1e-6


@dataclass(frozen=True)
class Mamba2Dims:
    """Sizes of a Mamba-2 model (mamba_ssm's Mamba2 / transformers' Mamba2Mixer).

    d_inner is d_ssm = nheads * headdim (the SSD width); conv_dim = d_inner + 2 * ngroups * d_state;
    in_proj's output [z | xBC | dt] has 2 * d_inner + 2 * ngroups * d_state + nheads rows.
    gnorm_eps: the gated RMSNorm's epsilon (mamba_ssm fixes 1e-5; transformers uses layer_norm_epsilon).
    """

    architecture: ClassVar[str] = "mamba2"
    d_model: int
    d_inner: int
    d_state: int
    d_conv: int
    n_layer: int
    vocab_size: int
    norm_eps: float
    ngroups: int
    headdim: int
    nheads: int
    chunk_size: int
    gnorm_eps: float

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.ngroups * self.d_state


@dataclass(frozen=True)
class HybridDims:
    """Sizes of a hybrid SSM-attention model (transformers' BambaForCausalLM: IBM Bamba, Granite 4.0-H).

    The harness's blocks are the decoder layers' sublayers: decoder layer i is block 2i (its mixer: a Mamba-2
    block or an attention block, each with its input RMSNorm and residual add) then block 2i+1 (its MLP with the
    pre-FFN RMSNorm and residual add); ``kinds[b]`` is block b's kind ("ssm", "attention" or "mlp") and n_layer
    the number of blocks (twice the decoder layers). The ssm fields are the Mamba-2 blocks' (``ssm_dims``); the
    attention's: n_heads query heads and n_kv_heads key/value heads of head_dim, RoPE of base rope_theta on the
    first rope_dim channels of each head; d_ff the MLP's width.
    """

    architecture: ClassVar[str] = "bamba"
    d_model: int
    n_layer: int
    vocab_size: int
    norm_eps: float
    kinds: tuple[str, ...]
    d_inner: int
    d_state: int
    d_conv: int
    ngroups: int
    headdim: int
    nheads: int
    chunk_size: int
    gnorm_eps: float
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_dim: int
    d_ff: int
    mlp_act: str = "silu_gated"  # the MLP: down(silu(gate(x)) * up(x)), or "relu2": down(relu(up(x))^2)

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.ngroups * self.d_state

    def ssm_dims(self) -> Mamba2Dims:
        """The Mamba-2 blocks' dims (n_layer: this model's block count)."""
        return Mamba2Dims(d_model=self.d_model, d_inner=self.d_inner, d_state=self.d_state, d_conv=self.d_conv,
                          n_layer=self.n_layer, vocab_size=self.vocab_size, norm_eps=self.norm_eps,
                          ngroups=self.ngroups, headdim=self.headdim, nheads=self.nheads, chunk_size=self.chunk_size,
                          gnorm_eps=self.gnorm_eps)


@dataclass(frozen=True)
class NemotronHDims(HybridDims):
    """A Nemotron-H hybrid (transformers' NemotronHForCausalLM): every layer is one block (its RMSNorm, one mixer:
    Mamba-2, attention without RoPE, or a ReLU^2 MLP, and the residual add), so kinds is the layer pattern."""

    architecture: ClassVar[str] = "nemotron_h"


# Calibrated activation scales of one block (spec notes §2.4), in the order the data flows.
SCALE_NAMES: tuple[str, ...] = ("s_in", "s_xz", "s_u", "s_xp", "s_dt", "s_h", "s_H")


@dataclass(frozen=True)
class LayerScales:
    """Per-tensor activation scales of one block, each an fp32-representable float.

    s_in  norm output = in_proj input          (min-max)
    s_xz  in_proj output, x and z halves       (min-max); conv input scale
    s_u   conv+SiLU output = x_proj input = u  (percentile)
    s_xp  x_proj output: dt, B and C           (min-max); dt_proj input scale
    s_dt  dt_proj output, before the bias      (min-max)
    s_h   SSM final state                      (percentile; decoding only)
    s_H   online Hadamard output = out_proj input (min-max)
    """

    s_in: float
    s_xz: float
    s_u: float
    s_xp: float
    s_dt: float
    s_h: float
    s_H: float

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in SCALE_NAMES}


class HookPoint(torch.nn.Module):
    """Identity module marking a capture site; forward hooks on it see the value passing by.

    ``point`` is the site name of ``harness.emulation.capture.POINTS`` (e.g. "ssm.u") and
    ``layer`` the block index, so capture derives names and never types them.
    """

    def __init__(self, point: str, layer: int) -> None:
        super().__init__()
        self.point = point
        self.layer = layer

    def forward(self, x):  # noqa: D102 - identity
        return x
