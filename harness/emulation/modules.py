"""Emulated Mamba-1 block: nn.Modules that hold prepared weights and call ``ops``.

The modules know nothing about modes: each is configured with its weights
(fp32 tensors or int8 ``QTensor``s), its output rule (``QuantOut``/``FloatOut``)
and, where needed, its input rule. ``harness.emulation.build`` decides those settings from
a recipe. Activations are fp32 tensors or QTensors; the residual stream is fp32.

Capture sites are ``HookPoint``s inside ``EmuMambaBlock`` (see capture.POINTS).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import nn

from ..modes import SsmU
from ..spec import Act, HookPoint, OutSpec, QTensor, QuantOut, Rounding
from .capture import POINTS, hook_attr
from ..kernels import portable
from ..kernels.conv1d import float_causal_conv1d_silu, int8_causal_conv1d_silu
from ..kernels.hadamard import hadamard_transform, hadamard_transform_fht
from ..kernels.linear import Epilogue, float_linear, w8a8_linear
from ..kernels.quant import dequantize, f32, quantize, quantize_prescaled, round_to_dtype, to_output
from ..kernels.scan import ScanOrder, selective_scan
from ..kernels.state_update import quant_state_update, requantize_state
from ..kernels.step import float_conv_update, int8_conv_update, shift_window, w8a8_gemv
from .norms import MIXER_NORM_SITES, EmuMixerNorms
from .state import BlockState, StateRule, conv_window, ssm_handover

__all__ = [
    "EmuRMSNorm", "EmuLinear", "ConvInput", "EmuConv1d", "EmuSelectiveScan", "EmuHadamard",
    "UInput", "EmuMambaBlock", "EmuBackbone", "BLOCK_POINTS",
]


class OpCache(Protocol):
    """What a block asks of a run-wide op cache (harness.runner.sharedops.SharedOps): fn(*args), or
    an earlier bit-identical call's result. The emulation only calls it; the runner owns it."""

    def call(self, layer: int, op: str, module: nn.Module | None, fn: Callable, *args): ...


BLOCK_POINTS: tuple[str, ...] = tuple(POINTS)  # the sites of capture.POINTS, in data-flow order


class EmuRMSNorm(nn.Module):
    """RMSNorm of the fp32 residual stream: y = r * rstd [* weight], then the output rule.

    rstd = 1 / sqrt(sum(r^2) / d_model + eps) (Triton's `rstd = 1 / tl.sqrt(var + eps)`,
    triton/quant_norm.py:111-114), with the sum in a fixed pairwise order and a correctly rounded
    sqrt (``kernels.portable``): the same bits on every CPU. torch.rsqrt, which prep=exact used before,
    differs from 1/sqrt by CPU and tensor size; both preps now compute this one formula.
    With the rotation the weight is folded into in_proj and is None. A quantized
    output is sat8(RNE(y / s_in)) (Triton `rint`, spec notes §2.6 step 1).
    """

    def __init__(self, weight: torch.Tensor | None, eps: float, out: OutSpec) -> None:
        super().__init__()
        self.weight, self.eps, self.out = weight, eps, out

    def forward(self, residual: torch.Tensor) -> Act:
        """residual: (batch, seqlen, d_model) fp32 -> (batch, seqlen, d_model)."""
        var = portable.mean_last(residual * residual)
        y = residual * (1.0 / portable.sqrt(var + self.eps))
        if self.weight is not None:
            y = y * self.weight
        return to_output(y, self.out)


class EmuLinear(nn.Module):
    """Linear layer without bias: the W8A8 kernel when input and weight are int8, else an fp32 matmul."""

    def __init__(self, weight: torch.Tensor | QTensor, order: Epilogue, out: OutSpec) -> None:
        super().__init__()
        self.weight, self.order, self.out = weight, order, out
        self._codes_f32: torch.Tensor | None = None  # the int8 weight as fp32, made by the first step

    def forward(self, x: Act) -> Act:
        """x: (..., in) -> (..., out)."""
        if isinstance(x, QTensor) and isinstance(self.weight, QTensor):
            return w8a8_linear(x, self.weight, self.order, self.out)
        return float_linear(x, self.weight, self.out)

    def step(self, x: Act) -> Act:
        """One token, x: (batch, 1, in): Quamba's W8A8 GEMV (one alpha, kernels.step) when both are int8."""
        if isinstance(x, QTensor) and isinstance(self.weight, QTensor):
            if self._codes_f32 is None:  # converted once, reused by every step
                self._codes_f32 = self.weight.codes.to(torch.float32)
            return w8a8_gemv(x, self.weight, self.out, self._codes_f32)
        return float_linear(x, self.weight, self.out)


@dataclass(frozen=True)
class ConvInput:
    """How the int8 conv gets its int8 input.

    kind "static": use the in_proj codes at s_xz, or quantize a float input at s_xz (RNE);
    kind "dynamic": re-quantize per call at max|x| / 127 over the whole tensor (RNE);
    kind "float": the conv is floating point and takes real values.
    """

    kind: str
    scale: float | None = None


class EmuConv1d(nn.Module):
    """Causal depthwise conv + SiLU (int8 kernel or fp32), output quantized with RNA or kept fp32."""

    def __init__(self, weight: torch.Tensor | QTensor, bias: torch.Tensor | QTensor | None,
                 input_rule: ConvInput, out: OutSpec, pre_silu: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight, self.bias, self.input_rule, self.out, self.pre_silu = weight, bias, input_rule, out, pre_silu

    def quantize_input(self, x: Act) -> Act:
        """x: (batch, seqlen, d_inner) -> the conv's actual input."""
        rule = self.input_rule
        if rule.kind == "float":
            return dequantize(x)
        if rule.kind == "static":
            return x if isinstance(x, QTensor) and x.scale == rule.scale else quantize(dequantize(x), rule.scale, Rounding.HALF_EVEN)
        xf = dequantize(x)
        amax = float(xf.abs().max())
        # qConvLayer.py:491-495: x_absmax / 127.0 (or 1.0 for an all-zero input), passed to the kernel as float
        return quantize(xf, f32(amax / 127.0) if amax > 0 else 1.0, Rounding.HALF_EVEN)

    def forward(self, x: Act) -> Act:
        """x: (batch, seqlen, d_inner) as returned by quantize_input -> (batch, seqlen, d_inner)."""
        if isinstance(x, QTensor):
            return int8_causal_conv1d_silu(x, self.weight, self.bias, self.out)
        return float_causal_conv1d_silu(x, self.weight, self.bias, self.out, self.pre_silu)

    def step_input(self, x: Act) -> Act:
        """One token's conv input: as ``quantize_input``, except that a dynamic input stays float (its
        window is quantized as a whole in ``step``)."""
        return dequantize(x) if self.input_rule.kind == "dynamic" else self.quantize_input(x)

    def window_of(self, x_in: Act, x_conv: Act) -> Act:
        """The window a prefill hands over (state.conv_window): the conv's own int8 input codes for a static
        input, the float in_proj output x_in for a dynamic one (re-quantized per step), else floats."""
        d_conv = self.weight.shape[1]
        return conv_window(x_conv if self.input_rule.kind == "static" else dequantize(x_in), d_conv)

    def step(self, x: Act, window: Act) -> tuple[Act, Act]:
        """One token x (batch, 1, d_inner) from ``step_input`` and the window before it -> (output
        (batch, 1, d_inner), the window after it). Dynamic input: the float window is quantized at
        max|window| / 127 (the tensor the update kernel sees), then the int8 update."""
        if self.input_rule.kind == "dynamic":
            win = shift_window(dequantize(window), dequantize(x)[:, 0])
            q = self.quantize_input(win)
            return _seq(int8_conv_update(q, self.weight, self.bias, self.out)), win
        if isinstance(x, QTensor):
            win = QTensor(shift_window(window.codes, x.codes[:, 0]), x.scale)
            return _seq(int8_conv_update(win, self.weight, self.bias, self.out)), win
        win = shift_window(dequantize(window), x[:, 0])
        return _seq(float_conv_update(win, self.weight, self.bias, self.out, self.pre_silu)), win


class EmuSelectiveScan(nn.Module):
    """The SSM with its (int8 or fp32) parameters A_log, D and dt_bias."""

    def __init__(self, A_log: torch.Tensor | QTensor, D: torch.Tensor | QTensor,
                 dt_bias: torch.Tensor | QTensor, order: ScanOrder, out: OutSpec, *,
                 state_rule: StateRule = StateRule(None), state_fmt: str | None = None) -> None:
        super().__init__()
        self.A_log, self.D, self.dt_bias, self.order, self.out = A_log, D, dt_bias, order, out
        self.state_rule = state_rule
        self.state_fmt = state_fmt  # a number format the state is stored in after every step (None: fp32)

    def forward(self, u: Act, delta: Act, B: Act, C: Act, z: Act) -> tuple[torch.Tensor, torch.Tensor]:
        """See kernels.scan.selective_scan; returns y (batch, seqlen, d_inner) and the final state."""
        return selective_scan(u, delta, self.A_log, B, C, self.D, z, delta_bias=self.dt_bias, order=self.order,
                              out=self.out, state_fmt=self.state_fmt)

    def step(self, u: Act, delta: Act, B: Act, C: Act, z: Act, h: Act) -> tuple[torch.Tensor, Act]:
        """One token (operands with a seqlen of 1) from the state h -> (y (batch, 1, d_inner), the new state).

        int8 state with ssm_impl=kernel: Quamba's Triton update (kernels.state_update); otherwise this scan's own
        order over one token from h (the prefill's arithmetic), the new state re-quantized at s_h like the
        kernel's, or rounded to the float state's dtype (mamba_ssm stores an fp16 model's state in fp16).
        """
        rule = self.state_rule
        if rule.s_h is not None and rule.kernel:
            y, q, _ = quant_state_update(h, _token(u), _token(delta), self.A_log, _token(B), _token(C), D=self.D,
                                         z=_token(z), dt_bias=self.dt_bias, out=self.out)
            return y[:, None], q
        y, new = selective_scan(u, delta, self.A_log, B, C, self.D, z, delta_bias=self.dt_bias, order=self.order,
                                out=self.out, h0=dequantize(h), state_fmt=self.state_fmt)
        return y, requantize_state(new, rule.s_h) if rule.s_h is not None else round_to_dtype(new, rule.dtype)


def _seq(x: Act) -> Act:
    """(batch, ...) -> (batch, 1, ...), a QTensor keeping its scale and clip count."""
    return QTensor(x.codes[:, None], x.scale, x.n_clipped) if isinstance(x, QTensor) else x[:, None]


def _token(x: Act) -> Act:
    """(batch, 1, ...) -> (batch, ...), a QTensor keeping its scale."""
    return QTensor(x.codes[:, 0], x.scale) if isinstance(x, QTensor) else x[:, 0]


class EmuHadamard(nn.Module):
    """Online Hadamard of the SSM output (QHadamard, spec notes §2.6 step 8).

    t = (H_b kron S) y, unnormalized; int8 output q = sat8(RNA(t * f32(1/sqrt(n) / s_H)))
    (qHadamard.py:34, common.h:153; saturating, see docs/fidelity.md); float output
    t / sqrt(n) in the output dtype. fht=False: t exact, rounded once to fp32 (prep=exact);
    fht=True: t with the kernel's fp32 butterflies (kernels.hadamard.hadamard_transform_fht; prep=quamba).
    """

    def __init__(self, out: OutSpec, fht: bool = False) -> None:
        super().__init__()
        self.out, self.fht = out, fht

    def forward(self, y: torch.Tensor) -> Act:
        """y: (batch, seqlen, d_inner) fp32 -> (batch, seqlen, d_inner)."""
        n = y.shape[-1]
        if isinstance(self.out, QuantOut):
            scale = f32((1.0 / math.sqrt(n)) / self.out.scale)
            if self.fht:
                return quantize_prescaled(hadamard_transform_fht(y, scale), self.out.scale, self.out.rounding)
            t = hadamard_transform(y, normalized=False).to(torch.float32)
            return quantize_prescaled(t * torch.tensor(scale, dtype=torch.float32), self.out.scale, self.out.rounding)
        if self.fht:
            return to_output(hadamard_transform_fht(y), self.out)
        return to_output(hadamard_transform(y), self.out)


@dataclass(frozen=True)
class UInput:
    """What the scan receives as u (knob ssm_u), and x_proj's input rule.

    ssm_u: "int8" codes as they are; "grid" dequantized to fp32 then re-quantized at s_u
    (RNE; must give the same codes); "requant" the fp32 conv output quantized at s_u (RNE);
    "fp32" the fp32 conv output itself. xproj_requant: quantize a float conv output at s_u
    (RNE) for an int8 x_proj.
    """

    ssm_u: str
    s_u: float | None
    xproj_requant: bool


class EmuMambaBlock(nn.Module):
    """One Mamba-1 block on the fp32 residual stream, with a HookPoint at every capture site."""

    def __init__(self, layer: int, dims, *, norm: EmuRMSNorm, in_proj: EmuLinear, conv1d: EmuConv1d,
                 x_proj: EmuLinear, dt_proj: EmuLinear, ssm: EmuSelectiveScan, had: EmuHadamard | None,
                 out_proj: EmuLinear, u_input: UInput, mixer_norms: EmuMixerNorms | None = None) -> None:
        super().__init__()
        self.layer, self.dims, self.u_input = layer, dims, u_input
        self.mixer_norms = mixer_norms  # Falcon-Mamba's dt/B/C norms (emulation.norms), None for Mamba-1
        self.norm, self.in_proj, self.conv1d = norm, in_proj, conv1d
        self.x_proj, self.dt_proj, self.ssm, self.had, self.out_proj = x_proj, dt_proj, ssm, had, out_proj
        sites = BLOCK_POINTS + (MIXER_NORM_SITES if mixer_norms is not None else ())
        self.hooks = nn.ModuleDict({hook_attr(p): HookPoint(p, layer) for p in sites})
        self.shared: OpCache | None = None  # a run's ops shared across modes (harness.runner.sharedops)

    def _op(self, name: str, module: nn.Module, *args):
        return module(*args) if self.shared is None else self.shared.call(self.layer, name, module, module, *args)

    def _at(self, point: str, x):
        return self.hooks[hook_attr(point)](x)

    def _split(self, dbl: Act) -> tuple[Act, Act, Act]:
        """x_proj's output -> dt_low, B, C; through the variant's norms where it has them."""
        sizes = [self.dims.dt_rank, self.dims.d_state, self.dims.d_state]
        dt, B, C = dbl.split(sizes) if isinstance(dbl, QTensor) else dbl.split(sizes, dim=-1)
        n = self.mixer_norms
        if n is None:
            return dt, B, C
        return (self._at("dt_norm.out", n.dt(dt)), self._at("b_norm.out", n.b(B)), self._at("c_norm.out", n.c(C)))

    def _xproj_input(self, conv_out: Act) -> Act:
        if isinstance(conv_out, QTensor) or not self.u_input.xproj_requant:
            return conv_out
        return quantize(conv_out, self.u_input.s_u, Rounding.HALF_EVEN)

    def _ssm_u(self, conv_out: Act) -> Act:
        rule = self.u_input
        if rule.ssm_u in (SsmU.INT8, SsmU.FP32):
            return conv_out
        if rule.ssm_u == SsmU.GRID:
            again = quantize(conv_out.dequantize(), rule.s_u, Rounding.HALF_EVEN)
            if not torch.equal(again.codes, conv_out.codes):
                raise RuntimeError(f"layer {self.layer}: dequantize -> requantize of u changed "
                                   f"{int((again.codes != conv_out.codes).sum())} codes (must be lossless)")
            return again
        return quantize(conv_out, rule.s_u, Rounding.HALF_EVEN)  # requant

    def forward(self, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """residual: (batch, seqlen, d_model) fp32 -> (mixer output, residual after the block), both fp32."""
        out, residual, _ = self._forward(residual)
        return out, residual

    def prefill(self, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, BlockState]:
        """``forward``, plus the state it hands to the first decode step (emulation.state)."""
        out, residual, (x_in, x_conv, h) = self._forward(residual)
        return out, residual, BlockState(self.conv1d.window_of(x_in, x_conv), ssm_handover(h, self.ssm.state_rule))

    def _forward(self, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        dims = self.dims
        # fmt: off
        residual = self._at("block.in", residual)
        normed   = self._at("norm.out", self._op("norm", self.norm, residual))   # (batch, seqlen, d_model)
        xz       = self._at("in_proj.out", self._op("in_proj", self.in_proj, normed))  # (batch, seqlen, 2 * d_inner)
        x_in, z  = xz.split([dims.d_inner, dims.d_inner]) if isinstance(xz, QTensor) else xz.split(dims.d_inner, dim=-1)
        x        = self._at("conv1d.in", self.conv1d.quantize_input(x_in))
        conv_out = self._at("conv1d.out", self._op("conv1d", self.conv1d, x))   # (batch, seqlen, d_inner)
        xp_in    = self._at("x_proj.in", self._xproj_input(conv_out))
        dbl      = self._at("x_proj.out", self._op("x_proj", self.x_proj, xp_in))  # (batch, seqlen, dt_rank + 2 * d_state)
        dt, B, C = self._split(dbl)
        delta    = self._at("dt_proj.out", self._op("dt_proj", self.dt_proj, dt))  # (batch, seqlen, d_inner), before the bias
        u        = self._at("ssm.u", self._ssm_u(conv_out))
        y, state = self._op("ssm", self.ssm, u, delta, B, C, z)
        y        = self._at("ssm.out", y)                                       # (batch, seqlen, d_inner)
        self._at("ssm.state", state)                                            # (batch, d_inner, d_state)
        if self.had is not None:
            y    = self._at("had.out", self._op("had", self.had, y))
        out      = self._at("out_proj.out", dequantize(self._op("out_proj", self.out_proj, y)))  # (batch, seqlen, d_model)
        # fmt: on
        out = self._at("block.out", out)
        return out, self._at("block.residual", residual + out), (x_in, x, state)

    def step(self, residual: torch.Tensor, state: BlockState) -> tuple[torch.Tensor, torch.Tensor, BlockState]:
        """One token: residual (batch, 1, d_model) fp32 and the state after the tokens before it -> (mixer output,
        residual after the block, the state after this token), through the same HookPoints as ``forward``
        (ssm.state excepted: the state is the returned one). The per-token ops are forward's; the linear
        layers run the GEMV, the conv its window update, the SSM its state update (docs/decode.md)."""
        dims = self.dims
        # fmt: off
        residual = self._at("block.in", residual)
        normed   = self._at("norm.out", self.norm(residual))
        xz       = self._at("in_proj.out", self.in_proj.step(normed))
        x, z     = xz.split([dims.d_inner, dims.d_inner]) if isinstance(xz, QTensor) else xz.split(dims.d_inner, dim=-1)
        x        = self._at("conv1d.in", self.conv1d.step_input(x))
        conv_out, window = self.conv1d.step(x, state.conv)
        conv_out = self._at("conv1d.out", conv_out)
        dbl      = self._at("x_proj.out", self.x_proj.step(self._at("x_proj.in", self._xproj_input(conv_out))))
        dt, B, C = self._split(dbl)
        delta    = self._at("dt_proj.out", self.dt_proj.step(dt))
        y, ssm   = self.ssm.step(self._at("ssm.u", self._ssm_u(conv_out)), delta, B, C, z, state.ssm)
        y        = self._at("ssm.out", y)
        if self.had is not None:
            y    = self._at("had.out", self.had(y))
        out      = self._at("block.out", self._at("out_proj.out", dequantize(self.out_proj.step(y))))
        # fmt: on
        return out, self._at("block.residual", residual + out), BlockState(window, ssm)


class EmuBackbone(nn.Module):
    """Embedding (a function of token ids) followed by blocks 0..depth; nothing after the last block."""

    def __init__(self, embed: Callable[[torch.Tensor], torch.Tensor], blocks: list[EmuMambaBlock]) -> None:
        super().__init__()
        self.embed = embed
        self.blocks = nn.ModuleList(blocks)

    @torch.no_grad()
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: (batch, seqlen) int64 -> residual stream after the last block, (batch, seqlen, d_model) fp32."""
        residual = self.embed(ids)
        for block in self.blocks:
            _, residual = block(residual)
        return residual

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> tuple[torch.Tensor, list[BlockState]]:
        """``forward``, plus every block's state for the first decode step."""
        residual, states = self.embed(ids), []
        for block in self.blocks:
            _, residual, state = block.prefill(residual)
            states.append(state)
        return residual, states

    @torch.no_grad()
    def step(self, ids: torch.Tensor, states: list[BlockState]) -> tuple[torch.Tensor, list[BlockState]]:
        """One token ids (batch, 1) from the blocks' states -> (residual after the last block, the new states)."""
        residual, new = self.embed(ids), []
        for block, state in zip(self.blocks, states):
            _, residual, state = block.step(residual, state)
            new.append(state)
        return residual, new
