"""The Quamba-SE fork's W8A8QMamba mixer methods (forward_mode5_X_eval, forward_mode6_X_eval, mode 4's forward) as
one emulated block: Quamba1's block (in_proj, the int8 conv, had and out_proj, built by the Mamba-1 knob
interpreter from Quamba1's preparation and calibration) with the fork's u quantizer, x_proj path and scan between
the conv and the Hadamard (modes.SeKnobs says which). Citations: 798253405/Quamba-SE f4d350a quamba/qMambaLayer.py.

Capture sites as every Mamba-1 mode: ``conv1d.out`` the fp32 conv output x_c, ``x_proj.in`` what x_proj multiplies
(int8 codes or fp32 values), ``ssm.u`` what the scan receives. ``segments`` holds, after each forward, the count of u's elements
and their squared error per segment of the quantizer (kernels.vquant.segment_sums; runner.forwards sums them).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...architectures.registry import get_architecture
from ...emulation.modules import EmuLinear, EmuMambaBlock, EmuSelectiveScan
from ...kernels import vquant as V
from ...kernels.conv1d import dequantized_conv1d_silu
from ...kernels.linear import Epilogue
from ...kernels.quant import dequantize, quantize
from ...kernels.scan import ScanOrder
from ...spec import FloatOut, QTensor, QuantOut, Rounding
from .modes import SeKnobs, knobs_of

__all__ = ["SeMambaBlock", "SeScales", "build_se_blocks", "quantize_u"]

_ORDERS = {"kernel": ScanOrder.KERNEL, "mamba": ScanOrder.MAMBA, "torch": ScanOrder.TORCH}
_FP32 = FloatOut(torch.float32)


@dataclass(frozen=True)
class SeScales:
    """What the fork's block reads beyond the u path: s (conv1d.output_scale = x_proj:input), s_xp (x_proj:output
    = B_scale = C_scale), s_dt (dt_proj:output = dt_scale), and 6-4's outlier scale (the alpha = 1.0 calibration's
    conv1d.output_scale of the layer, qMambaLayer.py:2690-2723; None for the other modes)."""

    s: float
    s_xp: float
    s_dt: float
    s_out: float | None = None


def quantize_u(x_c: torch.Tensor, knobs: SeKnobs, sc: SeScales) -> V.Segmented:
    """The scan's u from the fp32 conv output x_c, as the mode's quantizer (kernels.vquant) computes it."""
    u, r, div = knobs.u, knobs.u_round, knobs.div
    if u == "fp32":  # 5-1, 6-1: x_c itself (:1585-1596, :2451)
        return V.Segmented(x_c, torch.zeros_like(x_c, dtype=torch.long), ("fp32",))
    if u == "grid":
        return V.vq_grid(x_c, sc.s, r, div)
    if u == "outlier":
        return V.vq_outlier(x_c, sc.s, r, div)
    if u == "dual-dyn":  # 5-3: the scale of this call's tensor (batch- and sequence-dependent)
        return V.vq_dual(x_c, sc.s, V.dynamic_outlier_scale(x_c, sc.s, r, div), r, div)
    if u == "dual-cal":
        if sc.s_out is None:
            raise RuntimeError("6-4 needs the alpha=1.0 calibration's conv output scale (SeScales.s_out)")
        return V.vq_dual(x_c, sc.s, sc.s_out, r, div)
    if u == "quarter":
        return V.vq_fine(x_c, sc.s, 4, 32, r, div)
    if u == "half":
        return V.vq_fine(x_c, sc.s, 2, 64, r, div)
    if u == "quarterlog2":
        return V.vq_quarter_log2(x_c, sc.s, div)
    if u == "threeseg":
        return V.vq_three_segment(x_c, sc.s, div)
    raise ValueError(f"unknown u quantizer {u!r}")


class SeMambaBlock(EmuMambaBlock):
    """Quamba1's block with a Quamba-SE mode's middle (module docstring)."""

    def __init__(self, base: EmuMambaBlock, knobs: SeKnobs, sc: SeScales) -> None:
        fp = knobs.xproj == "fp"
        x_out = {"int8": QuantOut(sc.s_xp, Rounding.HALF_EVEN), "grid": QuantOut(sc.s_xp, Rounding.HALF_EVEN),
                 "fp": _FP32}[knobs.xproj_out]
        dt_out = _FP32 if knobs.dt_out == "fp" else QuantOut(sc.s_dt, Rounding.HALF_EVEN)
        ssm = base.ssm
        A_log = ssm.A_log if knobs.a_scale else ssm.A_log.codes.to(torch.float32)  # 6-2: -exp(A_log_q), :2553
        super().__init__(
            base.layer, base.dims, norm=base.norm, in_proj=base.in_proj, conv1d=base.conv1d,
            # 6-x: W8A8B8O8Linear.forward_mode6, F.linear on (W_q * weight_scale) (qLinearLayer.py:653-704)
            x_proj=EmuLinear(base.x_proj.weight, Epilogue.WEIGHT_THEN_RATIO, x_out) if fp else base.x_proj,
            dt_proj=EmuLinear(base.dt_proj.weight, Epilogue.RATIO_THEN_WEIGHT, dt_out) if fp else base.dt_proj,
            ssm=EmuSelectiveScan(A_log, ssm.D, ssm.dt_bias, _ORDERS[knobs.scan], ssm.out, state_rule=ssm.state_rule),
            had=base.had, out_proj=base.out_proj, u_input=base.u_input)
        self.knobs, self.sc = knobs, sc
        self.segments: tuple | None = None  # the last forward's (tap, names, counts, squared errors)

    def _conv(self, x) -> torch.Tensor:
        if self.knobs.conv == "torch":  # mode 4: qConvLayer.py:110-128
            return dequantized_conv1d_silu(x, self.conv1d.weight, self.conv1d.bias)
        return self._op("conv1d", self.conv1d, x)  # fwd_mode5: the int8 kernel's fp32 value (conv.cpp:307-371)

    def _xproj_in(self, x_c: torch.Tensor, u: torch.Tensor):
        k = self.knobs
        if k.xproj == "fp":
            return u
        return V.xproj_codes(x_c if k.xproj == "int8-conv" else u, self.sc.s, k.xproj_round, k.div)

    def _forward(self, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        dims, k = self.dims, self.knobs
        # fmt: off
        residual = self._at("block.in", residual)
        normed   = self._at("norm.out", self._op("norm", self.norm, residual))
        xz       = self._at("in_proj.out", self._op("in_proj", self.in_proj, normed))
        x_in, z  = xz.split([dims.d_inner, dims.d_inner])                        # int8 (qMambaLayer.py:1418-1419)
        x        = self._at("conv1d.in", self.conv1d.quantize_input(x_in))
        x_c      = self._at("conv1d.out", self._conv(x))                          # fp32 (batch, seqlen, d_inner)
        v        = quantize_u(x_c, k, self.sc)
        self.segments = ("ssm.u", v.names, *V.segment_sums(x_c, v))
        dbl      = self._at("x_proj.out", self.x_proj(self._at("x_proj.in", self._xproj_in(x_c, v.u))))
        sizes    = [dims.dt_rank, dims.d_state, dims.d_state]
        dt, B, C = dbl.split(sizes) if isinstance(dbl, QTensor) else dbl.split(sizes, dim=-1)
        delta    = self._at("dt_proj.out", self.dt_proj(dt))
        if k.dt_out == "requant":  # 6-4: B, C back to int8 at B_scale / C_scale (:2789-2799)
            B, C = quantize(B, self.sc.s_xp, Rounding.HALF_EVEN), quantize(C, self.sc.s_xp, Rounding.HALF_EVEN)
        u        = self._at("ssm.u", V.striped_u(v.u) if k.u_order == "striped" else v.u)
        y, state = self.ssm(u, delta, B, C, z)
        y        = self._at("ssm.out", y)
        self._at("ssm.state", state)
        if self.had is not None:
            y    = self._at("had.out", self._op("had", self.had, y))
        out      = self._at("out_proj.out", dequantize(self._op("out_proj", self.out_proj, y)))
        # fmt: on
        out = self._at("block.out", out)
        return out, self._at("block.residual", residual + out), (x_in, x, state)

    def prefill(self, residual):
        raise RuntimeError(_NO_DECODE)

    def step(self, residual, state):
        raise RuntimeError(_NO_DECODE)


_NO_DECODE = ("the Quamba-SE modes are prefill/log-likelihood only: the fork's eval forwards ignore the inference "
              "cache (never read or update conv_state/ssm_state, no step path; quamba/qMambaLayer.py:1404-2822)")


def build_se_blocks(mode, bank, scales: list, depth: int, calibration: bool = False) -> list[SeMambaBlock]:
    """Blocks 0..depth of a Quamba-SE mode: Quamba1's blocks of its base row (the Mamba-1 knob interpreter),
    each with the mode's middle. scales: per layer LayerScales, with ``s_out`` for 6-4 (family.SeLayerScales)."""
    knobs = knobs_of(mode)
    base = get_architecture("mamba1").build_blocks(mode, bank, scales, depth, calibration)
    return [SeMambaBlock(b, knobs, SeScales(s.s_u, s.s_xp, s.s_dt, getattr(s, "s_out", None)))
            for b, s in zip(base, scales)]
