"""The Quamba2 W8A8 Mamba-2 block (``W8A8QMamba2.forward``, enyac-group/Quamba c474646 quamba/qMamba2.py:1259-1334).

    q_u            = sat8(RNE(RMSNorm(residual) / s_in))                     norm.out
    z | x | B | C | dt (int8) = q2_in_proj(q_u)  (per-column factor b)      in_proj.z, in_proj.xBC, in_proj.dt
    x | B | C (int8) = q2_conv1d(x | B | C)  (x per group, B/C per SSD group) conv1d.x, conv1d.B, conv1d.C
    y, state       = SSD of the dequantized int8 inputs (ops.q2_ssd), y fp16  ssd.dt, ssd.y, ssd.state
    g              = QRMSNormGated(y, z) in fp16                               gnorm.out
    q_g            = sat8(RNA(Hadamard(g) / s_H))                              had.out
    out            = W8A8B16O16 out_proj(q_g), fp16                            out_proj.out

The block runs on the reordered channels and heads (emulation.q2_params). Its taps are real values
(codes x scales, fp32) put back in the model's own channel and head order, so that they compare with the
float modes position by position; ``had.out`` cannot be put back (a Hadamard of reordered channels is not a
reordering of the Hadamard), it stays in the reordered basis (docs/modes.md).

Diagnostics (docs/analysis.md "Quamba2 x groups"): ``x_probe``, when a caller sets it, is called after the
conv with the fp32 values of x that the grouped quantizer saw and their int8 codes, both in the reordered
channel order; ``x_groups()`` describes the groups. Unset (the default), the forward does nothing more.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..spec import FloatOut, Mamba2Dims, QuantOut, Rounding
from .mamba2 import EmuMamba2Block
from .modules import EmuHadamard, EmuLinear, EmuRMSNorm
from .ops.linear import Epilogue
from .ops.q2_ssd import Q2SSDParams, q2_ssd_inputs
from .ops.q2_w8a8 import q2_conv1d_quantize, q2_conv1d_values, q2_gated_norm, q2_in_proj
from .ops.quant import round_to_dtype
from .ops.ssd import ssd_chunked, ssd_ref
from .grouping_q2 import group_ranges
from .q2_params import Q2Params, Q2Scales

__all__ = ["EmuQ2Mamba2Block", "build_q2_block", "Q2_GNORM_EPS"]

# W8A8QMamba2 builds its QRMSNormGated with eps=1e-5 whatever the model's (quamba/qMamba2.py:1152)
Q2_GNORM_EPS = 1e-5


def _inverse(index: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(index)
    inv[index] = torch.arange(index.numel(), dtype=index.dtype)
    return inv


class EmuQ2Mamba2Block(EmuMamba2Block):
    """One Quamba2 W8A8 Mamba-2 block; the HookPoints of EmuMamba2Block at the same sites."""

    x_probe: Callable[[torch.Tensor, torch.Tensor], None] | None = None  # (x values, x codes), reordered

    def __init__(self, layer: int, dims: Mamba2Dims, params: Q2Params, scales: Q2Scales, *, chunked: bool,
                 norm: EmuRMSNorm, had: EmuHadamard, out_proj: EmuLinear, state_dtype: str = "int8") -> None:
        super().__init__(layer, dims, norm=norm, in_proj=None, conv1d=None, dt_bias=params.fp16.dt_bias, ssd=None,
                         gnorm=None, had=had, out_proj=out_proj)
        self.q, self.s, self.chunked = params, scales, chunked
        # the state_dtype knob: the SSM state the decode step starts from and keeps; "int8": Quamba2's cache, the
        # prefill's final state quantized at ssm_state_scale (quamba/triton/quant_ssd_combined.py:162,
        # quant_ssm_states.py:119) and re-quantized after every step; "fp32": never quantized. The prefill's own
        # outputs (y, every tap) never read the quantized state: forward is the same for both.
        self.state_dtype = state_dtype
        self.ch_back = _inverse(scales.reorder.channel_index.to(torch.int64))  # reordered -> model order
        self.head_back = _inverse(scales.reorder.head_index.to(torch.int64))

    def _ch(self, t: torch.Tensor) -> torch.Tensor:
        return t[..., self.ch_back]

    def _ssd(self, codes: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d, q = self.dims, self.q
        q_x, q_dt, q_B, q_C = codes
        b, L, _ = q_x.shape
        p = Q2SSDParams(q.A_log, q.D, q.fp16.dt_bias, self.s.s_dt, d.chunk_size)
        v = q2_ssd_inputs(p, q_x.reshape(b, L, d.nheads, d.headdim), q.x_scales, q_dt,
                          q_B=q_B.reshape(b, L, d.ngroups, d.d_state), B_scales=self.s.B_scales,
                          q_C=q_C.reshape(b, L, d.ngroups, d.d_state), C_scales=self.s.C_scales)
        args = (v["x"], v["dt"], v["A_log"], v["B"], v["C"], v["D"])
        y, state = ssd_chunked(*args, d.chunk_size) if self.chunked else ssd_ref(*args)
        # "output y is fp16" (Quamba c474646 quamba/qChunkScan.py:227-228)
        return v["dt"], round_to_dtype(y.reshape(b, L, d.d_inner), torch.float16), state

    def _in_proj(self, normed) -> torch.Tensor:
        """The int8 [z | xBC | dt] codes (W8A8B8O8LinearParallel; the W4A8 block overrides it)."""
        return q2_in_proj(normed, self.q.in_proj, self.q.in_proj_b)

    def x_groups(self) -> dict:
        """The grouping of x in the reordered channel order: SSD groups, headdim, the cumulative head and dim group
        ranges, every channel's output scale (fp32), and the scale table (x [g, head groups, dim groups], B and C
        per SSD group, the conv input's s_x)."""
        head_range, dim_range = group_ranges(self.s.reorder)
        return {"ngroups": self.dims.ngroups, "headdim": self.dims.headdim, "head_range": head_range.numpy(),
                "dim_range": dim_range.numpy(), "channel_scales": self.q.x_scales.cpu().numpy(),
                "table": {"x_table": self.s.x_table.tolist(), "x_head_group_range": head_range.tolist(),
                          "x_dim_group_range": dim_range.tolist(), "B_scales": self.s.B_scales.tolist(),
                          "C_scales": self.s.C_scales.tolist(), "s_x": self.s.s_x}}

    def prefill(self, residual: torch.Tensor):
        raise NotImplementedError("Quamba2's W8A8 decode step (int8 conv and SSM states) is not emulated")

    step = prefill

    def forward(self, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d, q, s = self.dims, self.q, self.s
        gs = d.ngroups * d.d_state
        residual = self._at("block.in", residual)
        normed = self.norm(residual)                                                   # QTensor at s_in
        self._at("norm.out", normed.dequantize())
        proj = self._in_proj(normed)                                                   # int8 codes, reordered
        z, xBC, dt = proj.split([d.d_inner, d.conv_dim, d.nheads], dim=-1)
        split_scales = (s.s_x, s.s_B, s.s_C)
        per_col = torch.tensor([s.s_x] * d.d_inner + [s.s_B] * gs + [s.s_C] * gs, dtype=torch.float32)
        xBC_real = xBC.to(torch.float32) * per_col
        self._at("in_proj.z", self._ch(z.to(torch.float32) * torch.tensor(s.s_z, dtype=torch.float32)))
        self._at("in_proj.xBC", torch.cat([self._ch(xBC_real[..., :d.d_inner]), xBC_real[..., d.d_inner:]], -1))
        self._at("in_proj.dt", (dt.to(torch.float32) * torch.tensor(s.s_dt, dtype=torch.float32))[..., self.head_back])
        w_codes, w_scales, b_codes, b_scales = q.conv
        values = q2_conv1d_values(xBC, split_scales, w_codes, w_scales, b_codes, b_scales, x_dim=d.d_inner)
        conv = q2_conv1d_quantize(values, q.conv_out)
        if self.x_probe is not None:
            self.x_probe(values[..., :d.d_inner], conv[..., :d.d_inner])
        q_x, q_B, q_C = conv.split([d.d_inner, gs, gs], dim=-1)
        self._at("conv1d.x", self._ch(q_x.to(torch.float32) * q.x_scales))
        self._at("conv1d.B", q_B.to(torch.float32) * s.B_scales.repeat_interleave(d.d_state))
        self._at("conv1d.C", q_C.to(torch.float32) * s.C_scales.repeat_interleave(d.d_state))
        dt_val, y, state = self._ssd((q_x, dt, q_B, q_C))
        self._at("ssd.dt", dt_val[..., self.head_back])
        self._at("ssd.y", self._ch(y))
        self._at("ssd.state", state[:, self.head_back])
        g = q2_gated_norm(y, z, s.s_z, q.fp16.gnorm_weight, d.ngroups, Q2_GNORM_EPS)    # fp16 values, reordered
        self._at("gnorm.out", self._ch(g))
        hq = self.had(g)                                                               # QTensor at s_H
        self._at("had.out", hq.dequantize())
        out = self._at("out_proj.out", self.out_proj(hq))                              # fp16 values
        out = self._at("block.out", out)
        return out, self._at("block.residual", residual + out)


def build_q2_block(layer: int, dims: Mamba2Dims, params: Q2Params, scales: Q2Scales, chunked: bool, *,
                   state_dtype: str = "int8") -> EmuQ2Mamba2Block:
    """The block with Quamba2's norm (int8 at s_in, RNE), online Hadamard (int8 at s_H, roundf, the kernel's
    fp32 butterflies) and out_proj (W8A8B16O16, the weight scale first, fp16 out), as Quamba1's W8A8 ones:
    W8A8QMamba2 uses the same QRMSNorm, QHadamard and W8A8B16O16Linear classes (qMamba2.py:1152-1160)."""
    return EmuQ2Mamba2Block(
        layer, dims, params, scales, chunked=chunked, state_dtype=state_dtype,
        norm=EmuRMSNorm(None, dims.norm_eps, QuantOut(scales.s_in, Rounding.HALF_EVEN)),
        had=EmuHadamard(QuantOut(scales.s_H, Rounding.HALF_AWAY), fht=True),
        out_proj=EmuLinear(params.out_proj, Epilogue.WEIGHT_THEN_RATIO, FloatOut(torch.float16)))
