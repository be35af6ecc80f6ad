"""The recurrent state a decode step carries per block: the conv window and the SSM state.

In Quamba1's W8A8 model both are int8 (``_get_states_from_cache`` / ``allocate_inference_cache``,
enyac-group/Quamba c474646 quamba/qMambaLayer.py:967-1004, dtype int8 at 988 and 995): the window holds the
last d_conv int8 in_proj x codes at s_xz (the conv's input, before the conv), the SSM state int8 codes at
s_h. A float model keeps both in its own dtype (mamba_ssm ``allocate_inference_cache``, enyac-group/mamba
f034308 mamba_simple.py:255-294: fp16 for an fp16 model, fp32 for the fp32 reference).

How the prefill hands its state over (qMambaLayer.py:915-919, 934-936): the window is ``F.pad(x, (K - L, 0))``,
the last K conv inputs with zeros in front when L < K; the SSM state is the final fp32 state, as int8 codes
rounded half away from zero (``ops.state_update.handover_codes``) or rounded to the float state's dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..spec import Act, QTensor
from .ops.quant import dequantize, round_to_dtype
from .ops.state_update import handover_codes

__all__ = ["StateRule", "BlockState", "conv_window", "ssm_handover"]


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
