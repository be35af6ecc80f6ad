"""Emulated Mamba-2 block (mamba_ssm's Mamba2, transformers' Mamba2Mixer) on the fp32 residual stream.

    normed        = RMSNorm(residual)                                   norm.out
    z | xBC | dt  = in_proj(normed)                                     in_proj.z, in_proj.xBC, in_proj.dt
    x | B | C     = SiLU(causal depthwise conv(xBC))                    conv1d.x, conv1d.B, conv1d.C
    dt            = softplus(dt + dt_bias)                              ssd.dt
    y, state      = SSD(x, dt, A_log, B, C, D) by heads and groups      ssd.y, ssd.state
    g             = gated group-wise RMSNorm(y, z)                      gnorm.out
    [g            = online Hadamard(g)]  (rotated recipes)              had.out
    out           = out_proj(g)                                         out_proj.out, block.out, block.residual

(transformers 5.23 models/mamba2/modeling_mamba2.py:474-604, the torch path; Mamba2Block :633-648.)

The decode step (``EmuMamba2Block.step``) is transformers' cached one-token path: the conv window holds the
last d_conv pre-conv xBC values (conv_dim channels: x, B and C; ``causal_conv1d_update`` :127-144: the window
and the new input concatenated, the conv's last output, the window shifted by one), the SSM state one
(headdim, d_state) matrix per head, updated by the recurrence (``mamba2_selective_state_update`` :195-254, called
at :548-566 with z=None; the gate is the gated norm's, :600). A prefill hands over the last d_conv xBC inputs
(``update_conv_state``, :520-526) and the SSD's final state (:574-594). States are stored in the mode's
act_dtype, as a float model stores them in its own dtype (``state.copy_(ssm_states.to(state.dtype))``, :233).
The modules hold prepared weights (harness.architectures.mamba2.weights) and output rules; build.py
configures them from a recipe. Capture sites are HookPoints named from capture.MAMBA2_POINTS.
"""
from __future__ import annotations

import torch
from torch import nn

from ...spec import Act, FloatOut, HookPoint, Mamba2Dims, OutSpec
from ...emulation.capture import MAMBA2_POINTS, hook_attr
from ...emulation.modules import EmuHadamard, EmuLinear, EmuRMSNorm, OpCache
from ...kernels.conv1d import float_causal_conv1d_silu
from ...kernels.quant import dequantize, to_output
from ...kernels.ssd import gated_rmsnorm, ssd_chunked, ssd_dt, ssd_ref
from ...emulation.state import BlockState, StateRule, conv_window, ssm_handover

__all__ = ["EmuConvXBC", "EmuSSD", "EmuGatedNorm", "EmuMamba2Block", "MAMBA2_BLOCK_POINTS"]

MAMBA2_BLOCK_POINTS: tuple[str, ...] = tuple(MAMBA2_POINTS)


class EmuConvXBC(nn.Module):
    """Causal depthwise conv + SiLU over the conv_dim channels x | B | C, in fp32 (kernels.conv1d), output rule after."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, out: OutSpec) -> None:
        super().__init__()
        self.weight, self.bias, self.out = weight, bias, out

    def forward(self, xBC: Act) -> torch.Tensor:
        """xBC: (batch, seqlen, conv_dim) -> (batch, seqlen, conv_dim)."""
        return to_output(float_causal_conv1d_silu(dequantize(xBC), self.weight, self.bias, FloatOut(torch.float32)),
                         self.out)

    def step(self, xBC: Act, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token xBC (batch, 1, conv_dim) and the window (batch, conv_dim, d_conv) of the d_conv inputs before
        it -> (the conv + SiLU output (batch, 1, conv_dim), the window ending with this token). The forward's
        arithmetic at the window's last position (transformers causal_conv1d_update, modeling_mamba2.py:127-144)."""
        new = torch.cat([window[..., 1:], dequantize(xBC).transpose(1, 2).to(window.dtype)], dim=-1)
        return self(new.transpose(1, 2))[:, -1:], new


class EmuSSD(nn.Module):
    """The SSD with its parameters: chunked (kernels.ssd.ssd_chunked) or token by token (ssd_ref)."""

    def __init__(self, dims: Mamba2Dims, A_log: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor,
                 chunked: bool, out: FloatOut, state_rule: StateRule = StateRule(None)) -> None:
        super().__init__()
        self.dims, self.A_log, self.D, self.dt_bias, self.chunked, self.out = dims, A_log, D, dt_bias, chunked, out
        self.state_rule = state_rule   # a float dtype only: Quamba2's int8 state is not a mode yet

    def forward(self, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor):
        """x: (batch, seqlen, d_inner); dt: (batch, seqlen, nheads) after softplus; B, C: (batch, seqlen,
        ngroups*d_state) -> y (batch, seqlen, d_inner) in the output dtype, state (batch, nheads, headdim, d_state)."""
        d = self.dims
        b, L, _ = x.shape
        xs = x.reshape(b, L, d.nheads, d.headdim)
        Bs, Cs = B.reshape(b, L, d.ngroups, d.d_state), C.reshape(b, L, d.ngroups, d.d_state)
        if self.chunked:
            y, state = ssd_chunked(xs, dt, self.A_log, Bs, Cs, self.D, d.chunk_size)
        else:
            y, state = ssd_ref(xs, dt, self.A_log, Bs, Cs, self.D)
        return to_output(y.reshape(b, L, d.d_inner), self.out), state

    def step(self, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token (operands with a seqlen of 1) from the state h (batch, d_inner, d_state) -> (y (batch, 1,
        d_inner), the new state (batch, d_inner, d_state) in the state dtype). The recurrence (ssd_ref from h)
        for both ssm_impl: the chunked form only exists over several tokens; the step is mamba2's
        selective_state_update (transformers modeling_mamba2.py:548-566)."""
        d = self.dims
        b = x.shape[0]
        heads = h.to(torch.float32).reshape(b, d.nheads, d.headdim, d.d_state)
        y, new = ssd_ref(x.reshape(b, 1, d.nheads, d.headdim), dt, self.A_log, B.reshape(b, 1, d.ngroups, d.d_state),
                         C.reshape(b, 1, d.ngroups, d.d_state), self.D, h0=heads)
        return to_output(y.reshape(b, 1, d.d_inner), self.out), ssm_handover(new.reshape(h.shape), self.state_rule)


class EmuGatedNorm(nn.Module):
    """norm(y * silu(z)) per group of d_inner / ngroups channels, times its weight (kernels.ssd.gated_rmsnorm)."""

    def __init__(self, weight: torch.Tensor, ngroups: int, eps: float, out: OutSpec) -> None:
        super().__init__()
        self.weight, self.ngroups, self.eps, self.out = weight, ngroups, eps, out

    def forward(self, y: torch.Tensor, z: Act) -> torch.Tensor:
        return to_output(gated_rmsnorm(y, dequantize(z), self.weight, self.ngroups, self.eps), self.out)


class EmuMamba2Block(nn.Module):
    """One Mamba-2 block, with a HookPoint at every site of capture.MAMBA2_POINTS."""

    def __init__(self, layer: int, dims: Mamba2Dims, *, norm: EmuRMSNorm, in_proj: EmuLinear, conv1d: EmuConvXBC,
                 dt_bias: torch.Tensor, ssd: EmuSSD, gnorm: EmuGatedNorm, had: EmuHadamard | None,
                 out_proj: EmuLinear) -> None:
        super().__init__()
        self.layer, self.dims, self.dt_bias = layer, dims, dt_bias
        self.norm, self.in_proj, self.conv1d, self.ssd, self.gnorm = norm, in_proj, conv1d, ssd, gnorm
        self.had, self.out_proj = had, out_proj
        self.hooks = nn.ModuleDict({hook_attr(p): HookPoint(p, layer) for p in MAMBA2_BLOCK_POINTS})
        self.shared: OpCache | None = None  # a run's ops shared across modes (harness.runner.sharedops)

    def _op(self, name: str, module: nn.Module, *args):
        return module(*args) if self.shared is None else self.shared.call(self.layer, name, module, module, *args)

    def _at(self, point: str, x):
        return self.hooks[hook_attr(point)](x)

    def forward(self, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """residual: (batch, seqlen, d_model) fp32 -> (mixer output, residual after the block), both fp32."""
        out, residual, _ = self._forward(residual)
        return out, residual

    def prefill(self, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, BlockState]:
        """``forward``, plus the state it hands to the first decode step: the last d_conv xBC inputs (zeros in
        front when shorter) and the final SSD state as (batch, d_inner, d_state), in the state dtype."""
        out, residual, (xBC, state) = self._forward(residual)
        b = state.shape[0]
        ssm = ssm_handover(state.reshape(b, self.dims.d_inner, self.dims.d_state), self.ssd.state_rule)
        return out, residual, BlockState(conv_window(xBC, self.dims.d_conv), ssm)

    def _forward(self, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        d = self.dims
        gs = d.ngroups * d.d_state
        # fmt: off
        residual = self._at("block.in", residual)
        normed   = self._at("norm.out", self._op("norm", self.norm, residual))          # (batch, seqlen, d_model)
        proj     = dequantize(self._op("in_proj", self.in_proj, normed))               # [z | xBC | dt]
        z, xBC, dt_raw = proj.split([d.d_inner, d.conv_dim, d.nheads], dim=-1)
        z        = self._at("in_proj.z", z)
        xBC      = self._at("in_proj.xBC", xBC)
        dt_raw   = self._at("in_proj.dt", dt_raw)
        conv     = self._op("conv1d", self.conv1d, xBC)                                 # (batch, seqlen, conv_dim)
        x, B, C  = conv.split([d.d_inner, gs, gs], dim=-1)
        x, B, C  = self._at("conv1d.x", x), self._at("conv1d.B", B), self._at("conv1d.C", C)
        dt       = self._at("ssd.dt", ssd_dt(dt_raw, self.dt_bias))                    # (batch, seqlen, nheads)
        y, state = self._op("ssd", self.ssd, x, dt, B, C)
        y        = self._at("ssd.y", y)                                                 # (batch, seqlen, d_inner)
        self._at("ssd.state", state)                                                    # (batch, nheads, headdim, d_state)
        g        = self._at("gnorm.out", self._op("gnorm", self.gnorm, y, z))
        if self.had is not None:
            g    = self._at("had.out", self._op("had", self.had, g))
        out      = self._at("out_proj.out", dequantize(self._op("out_proj", self.out_proj, g)))  # (batch, seqlen, d_model)
        # fmt: on
        out = self._at("block.out", out)
        return out, self._at("block.residual", residual + out), (xBC, state)

    def step(self, residual: torch.Tensor, state: BlockState) -> tuple[torch.Tensor, torch.Tensor, BlockState]:
        """One token: residual (batch, 1, d_model) fp32 and the state after the tokens before it -> (mixer output,
        residual after the block, the state after this token), through forward's HookPoints (ssd.state excepted:
        the state is the returned one); every per-token op is forward's, the conv runs its window and the SSD
        its recurrence from the carried state."""
        d = self.dims
        gs = d.ngroups * d.d_state
        # fmt: off
        residual = self._at("block.in", residual)
        normed   = self._at("norm.out", self.norm(residual))
        z, xBC, dt_raw = dequantize(self.in_proj.step(normed)).split([d.d_inner, d.conv_dim, d.nheads], dim=-1)
        z, xBC, dt_raw = self._at("in_proj.z", z), self._at("in_proj.xBC", xBC), self._at("in_proj.dt", dt_raw)
        conv, window = self.conv1d.step(xBC, state.conv)
        x, B, C  = conv.split([d.d_inner, gs, gs], dim=-1)
        x, B, C  = self._at("conv1d.x", x), self._at("conv1d.B", B), self._at("conv1d.C", C)
        dt       = self._at("ssd.dt", ssd_dt(dt_raw, self.dt_bias))
        y, ssm   = self.ssd.step(x, dt, B, C, state.ssm)
        g        = self._at("gnorm.out", self.gnorm(self._at("ssd.y", y), z))
        if self.had is not None:
            g    = self._at("had.out", self.had(g))
        out      = self._at("block.out", self._at("out_proj.out", dequantize(self.out_proj.step(g))))
        # fmt: on
        return out, self._at("block.residual", residual + out), BlockState(window, ssm)
