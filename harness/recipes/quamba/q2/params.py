"""Quamba2 W8A8 parameters of one Mamba-2 block: its calibrated scales, the head/dim reorder, the int8 weights.

Sources: enyac-group/Quamba at c474646.

Scales (W8A8QMamba2.from_fp16, quamba/qMamba2.py:1163-1257), observed on the reordered fp16 model
(run_quamba2_calibration, quamba/modelutils_mamba.py:236-372):

=========  ==============================  =====================================================
field      Quamba's act_scales key         observer
=========  ==============================  =====================================================
s_in       in_proj:input                   per-tensor min-max (fp16), the norm output
s_z        z_act:input / :output           per-tensor min-max (in_proj's z split, the gate)
s_x        x_conv_in:input / :output       per-tensor min-max (in_proj's x split, conv input)
s_B, s_C   B_conv_in / C_conv_in           per-tensor min-max
s_dt       dt_act:input / :output          per-tensor min-max (in_proj's dt split = the SSD's dt)
x_table    x_conv_out:input                CrossHeadMinmaxObserver, (ngroups, head groups, dim groups)
B_scales   B_conv_out:input                PerSSDGroupObserver, (ngroups,)
C_scales   C_conv_out:input                PerSSDGroupObserver, (ngroups,)
s_H        out_proj:input                  per-tensor min-max (the online Hadamard's output)
s_x_tensor x_conv_out:input (non-grouped)  per-tensor percentile (--percentile_alpha), for x_groups=tensor only
ssm_state  ssm_state_act:input             CachedStatesCrossHeadMinmaxObserver: (ngroups, head groups, dim groups,
                                           d_state), the final prefill state; used only by the decode step
=========  ==============================  =====================================================

``s_x_tensor`` is the one x scale of Quamba's non-grouped path (run_quamba_calibration, modelutils_mamba.py:125-132,
161-167: ``PerTensorPercentileObserver`` at ``x_conv_out``, the conv + SiLU output of x, qMamba2.py:221-229;
percentile_alpha 0.9995), observed in the same second pass as the others (a percentile of |x| over all channels
does not depend on their order). The grouped recipe never reads it; x_groups=tensor quantizes x at it in place
of the group table (emulation.build).

No percentile observer feeds q2-w8a8: Quamba2's
head-grouped calibration uses min-max observers only (modelutils_mamba.py:271-307; percentile is the
non-grouped path, :160-167, whose x observer s_x_tensor reproduces).

Reorder (reorder_mamba, quamba/reorder_utils.py:173-199): z and x rows of in_proj and x rows of conv1d take
the channel order, dt rows of in_proj, A_log, D and dt_bias the head order, the gated norm's weight and
out_proj's columns the channel order; applied to the checkpoint's tensors before the rotation is fused, as
Quamba reorders before ``fuse_had_matrices`` (modelutils_mamba.py:805-830).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .grouping import GroupReorder, group_ranges
from ....kernels.conv1d_grouped import conv_out_scales, x_channel_scales
from ....kernels.quant import quantize_param_fp32, quantize_weight_fp16, round_to_dtype
from ....architectures.mamba2.weights import Mamba2Params, float_layer_mamba2
from .weights import q2_conv_weights, q2_in_proj_weight

__all__ = ["Q2Scales", "Q2Params", "reorder_raw", "q2_params"]


@dataclass(frozen=True)
class Q2Scales:
    """One block's calibrated Quamba2 W8A8 scales and its reorder (module docstring)."""

    s_in: float
    s_z: float
    s_x: float
    s_B: float
    s_C: float
    s_dt: float
    x_table: torch.Tensor
    B_scales: torch.Tensor
    C_scales: torch.Tensor
    s_H: float
    reorder: GroupReorder
    s_x_tensor: float | None = None  # None: not observed (a checkpoint's scales)
    ssm_state_scale: torch.Tensor | None = None   # (ngroups, n_head_groups, n_dim_groups, d_state); decode only

    def info(self) -> dict:
        """Plain numbers for the provenance (the group tables and every scale)."""
        head_range, dim_range = group_ranges(self.reorder)
        return {"s_in": self.s_in, "s_z": self.s_z, "s_x": self.s_x, "s_B": self.s_B, "s_C": self.s_C,
                "s_dt": self.s_dt, "s_H": self.s_H, "x_table": self.x_table.tolist(),
                "B_scales": self.B_scales.tolist(), "C_scales": self.C_scales.tolist(),
                "x_head_group_range": head_range.tolist(), "x_dim_group_range": dim_range.tolist(),
                "head_index": self.reorder.head_index.tolist(),
                "ssm_state_scale": None if self.ssm_state_scale is None else self.ssm_state_scale.tolist(),
                **({} if self.s_x_tensor is None else {"s_x_tensor": self.s_x_tensor})}


@dataclass(frozen=True)
class Q2Params:
    """What the q2-w8a8 block computes with: the reordered fp16 parameters, in_proj codes and per-column
    factors, the conv codes and scales, the x channels' output scales, the SSD's int8 A_log and D.
    From q2_params, fp16.in_proj and fp16.out_proj are meta tensors (their shapes; the codes are the weights)."""

    fp16: Mamba2Params
    in_proj: torch.Tensor
    in_proj_b: torch.Tensor
    conv: tuple
    x_scales: torch.Tensor
    conv_out: torch.Tensor
    A_log: object
    D: object
    out_proj: object


def reorder_raw(raw: dict, r: GroupReorder, d_inner: int, nheads: int) -> dict:
    """The checkpoint tensors of one block with Quamba2's reorder applied (module docstring)."""
    ch, heads = r.channel_index.to(torch.int64), r.head_index.to(torch.int64)
    rows = torch.arange(raw["in_proj"].shape[0])
    rows[:d_inner] = ch
    rows[d_inner:2 * d_inner] = ch + d_inner
    rows[-nheads:] = heads + (raw["in_proj"].shape[0] - nheads)
    conv_rows = torch.arange(raw["conv_weight"].shape[0])
    conv_rows[:d_inner] = ch
    out = dict(raw)
    out["in_proj"] = raw["in_proj"][rows]
    out["conv_weight"] = raw["conv_weight"][conv_rows]
    out["conv_bias"] = None if raw["conv_bias"] is None else raw["conv_bias"][conv_rows]
    for name in ("A_log", "D", "dt_bias"):
        out[name] = raw[name][heads]
    out["gnorm_weight"] = raw["gnorm_weight"][ch]
    out["out_proj"] = raw["out_proj"][:, ch]
    return out


def q2_params(raw: dict, s: Q2Scales, dims) -> Q2Params:
    """Reorder, fold and rotate in fp16 (weights_mamba2), then quantize as W8A8QMamba2.from_fp16 does."""
    p = float_layer_mamba2(reorder_raw(raw, s.reorder, dims.d_inner, dims.nheads), True, torch.float16)
    bc = dims.ngroups * dims.d_state
    codes, b, _ = q2_in_proj_weight(p.in_proj, [dims.d_inner, dims.d_inner, bc, bc, dims.nheads],
                                    [s.s_z, s.s_x, s.s_B, s.s_C, s.s_dt])
    head_range, dim_range = group_ranges(s.reorder)
    x_scales = x_channel_scales(s.x_table, head_range, dim_range, x_dim=dims.d_inner, headdim=dims.headdim)
    # the block computes with the codes: fp16's in_proj and out_proj stay as their shapes only (meta tensors), not
    # 14 MB of float weights per 130m-shaped layer held for the whole mode
    return Q2Params(
        fp16=replace(p, in_proj=p.in_proj.to("meta"), out_proj=p.out_proj.to("meta")), in_proj=codes, in_proj_b=b, conv=q2_conv_weights(p.conv_weight, p.conv_bias, dims.d_inner, bc),
        x_scales=x_scales, conv_out=conv_out_scales(x_scales, s.B_scales, s.C_scales, dims.d_state),
        # Quamba2ChunkScan.from_fp16 (quamba/qChunkScan.py:105-121): per-tensor absmax int8 of A_log and D in
        # their parameter's dtype. In Quamba's fp16 model A_log is fp16 and D fp32 (state-spaces/mamba e9594ce
        # mamba_ssm/modules/mamba2.py:134 `A_log = torch.log(A).to(dtype=dtype)`, :139 D without a dtype).
        A_log=quantize_weight_fp16(round_to_dtype(p.A_log, torch.float16)), D=quantize_param_fp32(p.D),
        out_proj=quantize_weight_fp16(p.out_proj))
