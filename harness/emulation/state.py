"""The recurrent state a decode step carries per block: the conv window and the SSM state.

In Quamba1's W8A8 model both are int8 (``_get_states_from_cache`` / ``allocate_inference_cache``,
enyac-group/Quamba c474646 quamba/qMambaLayer.py:967-1004, dtype int8 at 988 and 995): the window holds the
last d_conv int8 in_proj x codes at s_xz (the conv's input, before the conv), the SSM state int8 codes at
s_h. A float model keeps both in its own dtype (mamba_ssm ``allocate_inference_cache``, enyac-group/mamba
f034308 mamba_simple.py:255-294: fp16 for an fp16 model, fp32 for the fp32 reference).

How the prefill hands its state over (qMambaLayer.py:915-919, 934-936): the window is ``F.pad(x, (K - L, 0))``,
the last K conv inputs with zeros in front when L < K; the SSM state is the final fp32 state, as int8 codes
rounded half away from zero (``kernels.state_update.handover_codes``) or rounded to the float state's dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..spec import Act, QTensor
from ..kernels.quant import dequantize, round_to_dtype
from ..kernels.ssd_step import dequantize_q2_state
from ..kernels.state_update import handover_codes

__all__ = ["StateRule", "BlockState", "Q2BlockState", "KVState", "conv_window", "ssm_handover"]


@dataclass(frozen=True)
class StateRule:
    """How a block stores its SSM state between steps: int8 at ``s_h`` (the W8A8 step), else floats of ``dtype``.

    kernel: the int8 step runs Quamba's Triton update order (ssm_impl=kernel); otherwise the recipe's own
    scan order over one token, with the same int8 re-quantization of the state.
    """

    s_h: float | None
    dtype: torch.dtype = torch.float32
    kernel: bool = False


@dataclass
class BlockState:
    """One block's state between tokens.

    conv: (batch, d_inner, d_conv), the last d_conv conv inputs (QTensor codes at s_xz for the int8 conv with
    a static input, else floats); ssm: (batch, d_inner, d_state), QTensor at s_h or floats.
    """

    conv: Act
    ssm: Act

    def conv_values(self) -> torch.Tensor:
        """The window as real values, fp32 (batch, d_inner, d_conv)."""
        return dequantize(self.conv)

    def ssm_values(self) -> torch.Tensor:
        """The SSM state as real values, fp32 (batch, d_inner, d_state)."""
        return dequantize(self.ssm)


@dataclass
class KVState:
    """An attention block's KV cache after the tokens so far: keys (after RoPE) and values, (batch, n_kv_heads,
    tokens, head_dim), as the block stored them (its output rule). It has no SSM state or conv window: the decode
    run records those of the blocks that have them."""

    k: torch.Tensor
    v: torch.Tensor


def conv_window(x: Act, d_conv: int) -> Act:
    """The window after a prefill over x (batch, seqlen, d_inner): F.pad(x, (K - L, 0)) of x as (batch, d_inner,
    seqlen), keeping a QTensor's codes and scale."""
    def last(t: torch.Tensor) -> torch.Tensor:
        t = t.transpose(1, 2)
        return F.pad(t, (max(0, d_conv - t.shape[-1]), 0))[..., -d_conv:].contiguous()
    if isinstance(x, QTensor):
        return QTensor(last(x.codes), x.scale)
    return last(x)


def ssm_handover(h: torch.Tensor, rule: StateRule) -> Act:
    """The prefill's final fp32 state h (batch, d_inner, d_state) as the first step's state."""
    if rule.s_h is not None:
        return handover_codes(h, rule.s_h)
    return round_to_dtype(h, rule.dtype)


@dataclass
class Q2BlockState:
    """One Quamba2 W8A8 block's state between tokens, in the block's reordered channel and head order.

    W8A8QMamba2's cache (enyac-group/Quamba c474646 quamba/qMamba2.py:1362-1400): the conv window holds int8 codes
    of the last d_conv conv inputs (in_proj's x | B | C codes at s_x, s_B, s_C); the SSM state int8 codes at the
    per-element ``ssm_state_scale``. ``allocate_inference_cache`` (:1362-1375, used with CUDA graphs,
    ``cg=True``: mamba_ssm utils/generation.py:308-315) makes the SSM state int8, ``_get_states_from_cache``
    (:1377-1400, the default ``cg=False`` of Quamba's generate.py:89, 179) fp16; both hold the same integer codes
    (the prefill's hand-over and every step store rint-ed values in [-128, 127], exact in fp16), so the dtype
    changes nothing and the harness keeps int8.

    conv_codes: (batch, conv_dim, d_conv) int8; conv_scales: (conv_dim,); ssm_codes: (batch, nheads, headdim,
    d_state) int8 (a float tensor holds the state's real values as they are); ssm_scales: (nheads, headdim,
    d_state); ch_back: (d_inner,) the reordered -> model channel gather.
    """

    conv_codes: torch.Tensor
    conv_scales: torch.Tensor
    ssm_codes: torch.Tensor
    ssm_scales: torch.Tensor
    ch_back: torch.Tensor

    def ssm_real(self) -> torch.Tensor:
        """The SSM state's real values in the block's order (batch, nheads, headdim, d_state) fp32."""
        if self.ssm_codes.dtype == torch.int8:
            return dequantize_q2_state(self.ssm_codes, self.ssm_scales)
        return self.ssm_codes.to(torch.float32)

    @property
    def ssm(self) -> torch.Tensor:
        """The SSM state dequantized, in the model's channel order: (batch, d_inner, d_state) fp32."""
        h = self.ssm_real()
        return h.reshape(h.shape[0], -1, h.shape[-1])[:, self.ch_back]

    @property
    def conv(self) -> torch.Tensor:
        """The window dequantized, x channels in the model's order: (batch, conv_dim, d_conv) fp32."""
        w = self.conv_codes.to(torch.float32) * self.conv_scales.to(torch.float32)[:, None]
        d = self.ch_back.numel()
        return torch.cat([w[:, :d][:, self.ch_back], w[:, d:]], dim=1)

    def conv_values(self) -> torch.Tensor:
        return self.conv

    def ssm_values(self) -> torch.Tensor:
        return self.ssm
