"""MambaQuant's scan (MambaQuant/MambaQuant@a4803c4 model_llm/mamba_py/modeling_mamba.py:444-483): the recurrence in
fp32 keeping every state h_t (batch, seqlen, d_inner, d_state), then the output contraction y_t = h_t . C_t as a
QuantMatMul of both operands (:461-470; int_matmul.py:43-56) -- the only place the state is quantized -- with the
online S3 division and R3 rotation of h along d_inner around it (:464-470), y += u * D, and the gate act_gate(z),
which S2 replaces by x * sigmoid(s * x) (quant_naive.py:588-605). B, u, dt, the recurrence and the gate are not
quantized. The harness's block gives the scan dt_proj's output before its bias (emulation.modules), added here."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ...emulation.state import StateRule

__all__ = ["MQScan"]

Fn = Callable[[torch.Tensor], torch.Tensor]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


class MQScan(nn.Module):
    """forward(u, delta, B, C, z) -> (y, last state), as EmuSelectiveScan (decode is not supported)."""

    def __init__(self, A_log: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor, *, gate_s: torch.Tensor | None,
                 R3: torch.Tensor | None, S3: torch.Tensor | None, quant_h: Fn = _identity, quant_c: Fn = _identity,
                 observe: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> None:
        super().__init__()
        self.A_log, self.D, self.dt_bias, self.gate_s = A_log, D, dt_bias, gate_s
        self.R3, self.S3, self.quant_h, self.quant_c, self.observe = R3, S3, quant_h, quant_c, observe
        self.state_rule = StateRule(None)  # the prefill's fp32 state (there is no decode step: ``step``)

    def forward(self, u, delta, B, C, z):
        dt = F.softplus(delta + self.dt_bias)                              # (b, L, E), transformers' softplus
        A = -torch.exp(self.A_log)                                         # (E, N)
        dA = torch.exp(dt[..., None] * A)                                  # (b, L, E, N)
        dBu = dt[..., None] * B[:, :, None, :] * u[..., None]
        h = torch.zeros_like(dA[:, 0])
        states = []
        for t in range(u.shape[1]):
            h = dA[:, t] * h + dBu[:, t]
            states.append(h)
        H = torch.stack(states, dim=1)
        if self.observe is not None:
            self.observe(H, C)
        if self.S3 is not None:
            H = H / self.S3[:, None]
        if self.R3 is not None:
            H = torch.einsum("blen,ef->blfn", H, self.R3)
        y = torch.einsum("blen,bln->ble", self.quant_h(H), self.quant_c(C))
        if self.R3 is not None:
            y = y @ self.R3.T
        if self.S3 is not None:
            y = y * self.S3
        y = y + u * self.D
        gate = F.silu(z) if self.gate_s is None else z * torch.sigmoid(z * self.gate_s)
        return y * gate, h

    def step(self, *args):
        raise NotImplementedError("MambaQuant's modes have no decode step: their activation scales are per sequence "
                                  "(docs/field-recipes.md); run them without --decode")
