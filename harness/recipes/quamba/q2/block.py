"""The Quamba2 W8A8 Mamba-2 block (``W8A8QMamba2.forward``, enyac-group/Quamba c474646 quamba/qMamba2.py:1259-1334).

    q_u            = sat8(RNE(RMSNorm(residual) / s_in))                     norm.out
    z | x | B | C | dt (int8) = q2_in_proj(q_u)  (per-column factor b)      in_proj.z, in_proj.xBC, in_proj.dt
    x | B | C (int8) = q2_conv1d(x | B | C)  (x per group, B/C per SSD group) conv1d.x, conv1d.B, conv1d.C
    y, state       = SSD of the dequantized int8 inputs (kernels.ssd_inputs), y fp16  ssd.dt, ssd.y, ssd.state
    g              = QRMSNormGated(y, z) in fp16                               gnorm.out
    q_g            = sat8(RNA(Hadamard(g) / s_H))                              had.out
    out            = W8A8B16O16 out_proj(q_g), fp16                            out_proj.out

The block runs on the reordered channels and heads (recipes.quamba.q2.params). Its taps are real values
(codes x scales, fp32) put back in the model's own channel and head order, so that they compare with the
float modes position by position; ``had.out`` cannot be put back (a Hadamard of reordered channels is not a
reordering of the Hadamard), it stays in the reordered basis (docs/modes.md). A tap with one scale (norm.out,
in_proj.z, in_proj.dt, had.out; conv1d.B and conv1d.C when every SSD group has the same scale) passes its
HookPoint as a QTensor, so the capture records its codes, scale and saturation as Mamba-1's int8 taps; the
values are the same (codes x scale in fp32). in_proj.xBC and conv1d.x carry several scales and pass as floats.

Diagnostics (docs/analysis.md "Quamba2 x groups"): ``x_probe``, when a caller sets it, is called after the
conv with the fp32 values of x that the grouped quantizer saw and their int8 codes, both in the reordered
channel order; ``x_groups()`` describes the groups. Unset (the default), the forward does nothing more.
"""
from __future__ import annotations

from typing import Callable

import torch

from ....spec import ChannelQTensor, FloatOut, Mamba2Dims, QTensor, QuantOut, Rounding
from ....architectures.mamba2.block import EmuMamba2Block
from ....emulation.modules import EmuHadamard, EmuLinear, EmuRMSNorm
from ....kernels.linear import Epilogue
from .grouping import group_ranges
from ....kernels.ssd_inputs import Q2SSDParams, q2_ssd_inputs
from ....kernels.ssd_step import handover_q2_state, q2_conv_update, q2_gemv, q2_state_scales, q2_state_update, \
    requantize_q2_state
from ....kernels.conv1d_grouped import q2_conv1d_quantize, q2_conv1d_values
from ....kernels.norms import q2_gated_norm
from ....kernels.linear import q2_in_proj
from ....kernels.quant import round_to_dtype
from ....kernels.ssd import ssd_chunked, ssd_ref
from .params import Q2Params, Q2Scales
from ....emulation.state import Q2BlockState, conv_window

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
        head_range, dim_range = group_ranges(scales.reorder)
        table = scales.ssm_state_scale   # None: scales without the state observer, which cannot decode
        self.state_scales = None if table is None else \
            q2_state_scales(table, head_range, dim_range, dims.nheads, dims.headdim)

    def _ch(self, t: torch.Tensor) -> torch.Tensor:
        return t[..., self.ch_back]

    def _ssd(self, codes: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d, q = self.dims, self.q
        q_x, q_dt, q_B, q_C = codes
        b, L, _ = q_x.shape
        v = q2_ssd_inputs(self._ssd_params(), q_x.reshape(b, L, d.nheads, d.headdim), q.x_scales, q_dt,
                          q_B=q_B.reshape(b, L, d.ngroups, d.d_state), B_scales=self.s.B_scales,
                          q_C=q_C.reshape(b, L, d.ngroups, d.d_state), C_scales=self.s.C_scales)
        args = (v["x"], v["dt"], v["A_log"], v["B"], v["C"], v["D"])
        y, state = ssd_chunked(*args, d.chunk_size) if self.chunked else ssd_ref(*args)
        # "output y is fp16" (Quamba c474646 quamba/qChunkScan.py:227-228)
        return v["dt"], round_to_dtype(y.reshape(b, L, d.d_inner), torch.float16), state

    def _in_proj(self, normed) -> torch.Tensor:
        """The int8 [z | xBC | dt] codes (W8A8B8O8LinearParallel; the W4A8 block overrides it)."""
        return q2_in_proj(normed, self.q.in_proj, self.q.in_proj_b)

    def _step_in_proj(self, normed) -> torch.Tensor:
        """The int8 codes of one token: W8A8's GEMV (kernels.ssd_step.q2_gemv; the W4A8 block overrides it)."""
        return q2_gemv(normed, self.q.in_proj, self.q.in_proj_b)

    def x_groups(self) -> dict:
        """The grouping of x in the reordered channel order: SSD groups, headdim, the cumulative head and dim group
        ranges, every channel's output scale (fp32), and the scale table (x [g, head groups, dim groups], B and C
        per SSD group, the conv input's s_x)."""
        head_range, dim_range = group_ranges(self.s.reorder)
        return {"ngroups": self.dims.ngroups, "headdim": self.dims.headdim, "head_range": head_range.cpu().numpy(),
                "dim_range": dim_range.cpu().numpy(), "channel_scales": self.q.x_scales.cpu().numpy(),
                "table": {"x_table": self.s.x_table.tolist(), "x_head_group_range": head_range.tolist(),
                          "x_dim_group_range": dim_range.tolist(), "B_scales": self.s.B_scales.tolist(),
                          "C_scales": self.s.C_scales.tolist(), "s_x": self.s.s_x}}

    def _ssd_params(self) -> Q2SSDParams:
        return Q2SSDParams(self.q.A_log, self.q.D, self.q.fp16.dt_bias, self.s.s_dt, self.dims.chunk_size)

    def _tap_proj(self, proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """in_proj's int8 codes (reordered) -> z, xBC, dt codes, through their HookPoints as real values."""
        d, s = self.dims, self.s
        z, xBC, dt = proj.split([d.d_inner, d.conv_dim, d.nheads], dim=-1)
        scales = self._conv_in_scales()
        self._at("in_proj.z", QTensor(self._ch(z), s.s_z))              # codes x s_z, as the capture records it
        self._at("in_proj.xBC", ChannelQTensor(torch.cat([self._ch(xBC[..., :d.d_inner]), xBC[..., d.d_inner:]], -1),
                                               torch.cat([self._ch(scales[:d.d_inner]), scales[d.d_inner:]])))
        self._at("in_proj.dt", QTensor(dt[..., self.head_back], s.s_dt))
        return z, xBC, dt

    def _conv_in_scales(self) -> torch.Tensor:
        """(conv_dim,) the conv input scale of every channel: s_x, s_B, s_C (in_proj's split output scales)."""
        d, s = self.dims, self.s
        gs = d.ngroups * d.d_state
        return torch.tensor([s.s_x] * d.d_inner + [s.s_B] * gs + [s.s_C] * gs, dtype=torch.float32)

    def _tap_conv(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d, q, s = self.dims, self.q, self.s
        gs = d.ngroups * d.d_state
        q_x, q_B, q_C = conv.split([d.d_inner, gs, gs], dim=-1)
        self._at("conv1d.x", ChannelQTensor(self._ch(q_x), self._ch(q.x_scales)))
        self._at("conv1d.B", self._per_group(q_B, s.B_scales))
        self._at("conv1d.C", self._per_group(q_C, s.C_scales))
        return q_x, q_B, q_C

    def _per_group(self, codes: torch.Tensor, scales: torch.Tensor) -> QTensor | ChannelQTensor:
        """B or C codes with one scale per SSD group: a QTensor when the groups share one scale, else a scale per
        channel."""
        if bool((scales == scales[0]).all()):
            return QTensor(codes, float(scales[0]))
        return ChannelQTensor(codes, scales.repeat_interleave(self.dims.d_state))

    def _output(self, y: torch.Tensor, z: torch.Tensor, residual: torch.Tensor, step: bool):
        """The gated norm, the Hadamard and out_proj (the GEMV on one token: EmuLinear.step, W8A8B16O16's
        ``cutlass_scaled_mv_dq`` with alpha = f32(s_w * s_H), quamba/qLinearLayer.py:784, 812-813)."""
        d, q, s = self.dims, self.q, self.s
        self._at("ssd.y", self._ch(y))
        g = q2_gated_norm(y, z, s.s_z, q.fp16.gnorm_weight, d.ngroups, Q2_GNORM_EPS)    # fp16 values, reordered
        self._at("gnorm.out", self._ch(g))
        hq = self.had(g)                                                               # QTensor at s_H
        self._at("had.out", hq)
        out = self._at("out_proj.out", self.out_proj.step(hq) if step else self.out_proj(hq))   # fp16 values
        out = self._at("block.out", out)
        return out, self._at("block.residual", residual + out)

    def forward(self, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, residual, _ = self._forward(residual)
        return out, residual

    def _forward(self, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        q, s = self.q, self.s
        residual = self._at("block.in", residual)
        normed = self.norm(residual)                                                   # QTensor at s_in
        self._at("norm.out", normed)
        z, xBC, dt = self._tap_proj(self._in_proj(normed))                            # int8 codes, reordered
        w_codes, w_scales, b_codes, b_scales = q.conv
        values = q2_conv1d_values(xBC, (s.s_x, s.s_B, s.s_C), w_codes, w_scales, b_codes, b_scales,
                                  x_dim=self.dims.d_inner)
        conv = q2_conv1d_quantize(values, q.conv_out)
        if self.x_probe is not None:
            self.x_probe(values[..., :self.dims.d_inner], conv[..., :self.dims.d_inner])
        q_x, q_B, q_C = self._tap_conv(conv)
        dt_val, y, state = self._ssd((q_x, dt, q_B, q_C))
        self._at("ssd.dt", dt_val[..., self.head_back])
        # back to the model's order: heads and the channels inside each head (channel_index reorders both)
        b = state.shape[0]
        self._at("ssd.state", state.reshape(b, self.dims.d_inner, -1)[:, self.ch_back].reshape(state.shape))
        out, residual = self._output(y, z, residual, step=False)
        return out, residual, (xBC, state)

    def prefill(self, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Q2BlockState]:
        """``forward``, plus the state it hands to the first step (qMamba2.py:1305-1320): the last d_conv int8
        xBC codes (zeros in front when shorter) and the final state as int8 codes (kernels.ssd_step.handover_q2_state)."""
        if self.state_scales is None and self.state_dtype == "int8":
            raise ValueError("these q2-w8a8 scales have no ssm_state_scale: the decode step needs a calibration "
                             "that observed the SSM state (harness.recipes.quamba.q2.calibration)")
        out, residual, (xBC, state) = self._forward(residual)
        window = conv_window(xBC, self.dims.d_conv)
        scales = torch.empty(0) if self.state_scales is None else self.state_scales
        return out, residual, Q2BlockState(window, self._conv_in_scales(), self.store_state(state, handover=True),
                                           scales, self.ch_back)

    def store_state(self, h: torch.Tensor, handover: bool = False) -> torch.Tensor:
        """The state the next step starts from, the one place that decides its form: with state_dtype int8 the
        fp32 values re-quantized by the kernel's rule (selective_state_update.py:355; the prefill's hand-over first
        rounds to fp16, kernels.ssd_step.handover_q2_state); with fp32 the values as they are."""
        if self.state_dtype == "fp32":
            return h.to(torch.float32)
        return handover_q2_state(h, self.state_scales) if handover else requantize_q2_state(h, self.state_scales)

    def step(self, residual: torch.Tensor, state: Q2BlockState) -> tuple[torch.Tensor, torch.Tensor, Q2BlockState]:
        """One token through W8A8QMamba2.step (qMamba2.py:1336-1360): norm, the in_proj GEMV, the conv-window
        update, the SSM state update from the int8 state, the gated norm, Hadamard and the out_proj GEMV; the same
        HookPoints as forward (ssd.state excepted: the state is the returned one)."""
        d, q, s = self.dims, self.q, self.s
        residual = self._at("block.in", residual)
        normed = self.norm(residual)
        self._at("norm.out", normed)
        z, xBC, dt = self._tap_proj(self._step_in_proj(normed))
        conv, window = q2_conv_update(state.conv_codes, xBC[:, 0], (s.s_x, s.s_B, s.s_C), q.conv, q.conv_out,
                                      x_dim=d.d_inner)
        q_x, q_B, q_C = self._tap_conv(conv[:, None])
        b = q_x.shape[0]
        y, h, dt_val = q2_state_update(self._ssd_params(), state.ssm_real(), q_x.reshape(b, d.nheads, d.headdim),
                                       q.x_scales.reshape(d.nheads, d.headdim), dt[:, 0],
                                       q_B=q_B.reshape(b, d.ngroups, d.d_state), B_scales=s.B_scales,
                                       q_C=q_C.reshape(b, d.ngroups, d.d_state), C_scales=s.C_scales)
        self._at("ssd.dt", dt_val[:, None][..., self.head_back])
        out, residual = self._output(y.reshape(b, 1, d.d_inner), z, residual, step=True)
        return out, residual, Q2BlockState(window, state.conv_scales, self.store_state(h), self.state_scales,
                                           self.ch_back)


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
