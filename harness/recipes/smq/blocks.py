"""SmQ-SSM's blocks (docs/field-recipes.md "SmQ-SSM"): SmoothQuant for Mamba-1 as Quamba1's simulated path computes it
with --do_smoothing, the name lookup patched as PTQ-SSM's copy does (the notes §2).

enyac-group/Quamba@624361b quamba/fake_quant/modelutils_mamba.py:152-166: replace the mixers, smooth, quantize the
weights per tensor, calibrate the static activation scales *on the smoothed model*, switch quantization on.
Four smoothing points (qMambaLayer.py:86-88, qSelectiveScan.py:43), each dividing its input online by a
per-channel vector s (smooth_quant_utils.py:17-26) and multiplying the columns of one weight by s:

==================  ===========================  =====================  ====================================
SmoothModule        activation (channels)        weight that absorbs s  here
==================  ===========================  =====================  ====================================
mamba_in_smooth     norm output (D)              in_proj                in_proj input / s, then mamba_in_quant
u_smooth            conv+SiLU output u (E)       x_proj                 q(u / s) * s for the scan (qMambaLayer
                                                                        .py:168-174); x_proj takes q(u / s)
dt_smooth           dt-rank slice (R)            dt_proj                dt_proj input / s, dt_proj_in_quant
ssm_out_smooth      gated SSM output y (E)       out_proj               out_proj input / s, ssm_out_quant
==================  ===========================  =====================  ====================================

s_c = (a_c^alpha / w_c^(1-alpha)).clamp(1e-5), a_c the per-channel max |x| of the unsmoothed model, w_c the
column absmax of the original weight (smooth_fc, smooth_quant_utils.py:75-89; alpha 0.5 at :107). As released,
smooth_mamba resolves ssm_out_smooth's weight as ``mixer.q_sscan.out_proj`` (smooth_quant_utils.py:99-104), which
does not exist: the first call raises AttributeError before any weight changes; PTQ-SSM (mikequ1/PTQ-SSM@67d764b
Quamba/quamba/fake_quant/smooth_quant_utils.py:99-102) targets ``mixer.out_proj``, as here.
"""
from __future__ import annotations

import torch

from ...architectures.registry import get_architecture
from ...emulation.fakequant import AmaxObserver, ChannelAmaxObserver, wrap_mamba1
from ...kernels.fakequant import fq_sym, fq_sym_dynamic
from ...kernels.field_transforms import smooth_factors
from ...modes import ModeRecipe

__all__ = ["Q1_POINTS", "SMOOTHED", "build", "observe_channels", "observe_scales", "smoothing_vectors", "static_scale"]

Q1_POINTS = ("mamba_in", "conv_in", "z", "u", "dt_proj_in", "dt", "B", "C", "ssm_out")
# smoothing vector -> the weight that absorbs it (the point it smooths is SMOOTHED's value)
SMOOTHED: dict[str, str] = {"mamba_in": "in_proj", "u": "x_proj", "dt_proj_in": "dt_proj", "ssm_out": "out_proj"}
_AT = {"mamba_in": "in_proj.in", "u": "x_proj.in", "dt_proj_in": "dt_proj.in", "ssm_out": "out_proj.in"}


def _float_blocks(mode: ModeRecipe, bank, depth: int) -> list:
    return get_architecture(bank.dims.architecture).build_blocks(mode, bank, None, depth, False)


def static_scale(amax: float) -> float:
    """max|x|.clamp(1e-5) / 127 in fp32 (Quamba1 observer.py:14-28)."""
    return float(torch.tensor(max(amax, 1e-5), dtype=torch.float32) / 127)


def observe_channels(mode: ModeRecipe, bank, depth: int) -> tuple[list, list[dict]]:
    """Pass 1: the fp32 model with a per-channel max |x| observer at each smoothing point's input."""
    blocks = _float_blocks(mode, bank, depth)
    observers = [{p: ChannelAmaxObserver() for p in SMOOTHED} for _ in blocks]
    for block, obs in zip(blocks, observers):
        wrap_mamba1(block, {_AT[p]: o for p, o in obs.items()})
    return blocks, observers


def smoothing_vectors(bank, layer: int, amax: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """s per smoothing point of one layer, from its pass-1 statistics and the layer's original weights."""
    p = bank.layer(layer, "fp32", False, "exact")
    return {f"s_{pt}": smooth_factors(amax[pt], getattr(p, w), alpha) for pt, w in SMOOTHED.items()}


def _table(fns: dict, s: dict[str, torch.Tensor], quantize_u) -> dict:
    """The block's points: each smoothed input divided by s before its function (u: q(u / s) * s for the scan)."""
    def div(fn, v):
        return lambda x: fn(x / v)
    s_u = s["s_u"]
    return {"in_proj.in": div(fns["mamba_in"], s["s_mamba_in"]), "conv.in": fns["conv_in"], "scan.z": fns["z"],
            "conv.out": lambda u: quantize_u(u / s_u) * s_u, "x_proj.in": lambda u: u / s_u,
            "dt_proj.in": div(fns["dt_proj_in"], s["s_dt_proj_in"]), "dt_proj.out": fns["dt"],
            "scan.B": fns["B"], "scan.C": fns["C"], "out_proj.in": div(fns["ssm_out"], s["s_ssm_out"])}


def _smooth_weights(block, s: dict[str, torch.Tensor], quantize: bool) -> None:
    """W[:, c] *= s_c for the four weights (new tensors: the bank's are shared), then per-tensor absmax when
    quantizing (the weights quantizers, configured after smoothing: modelutils_mamba.py:158-160)."""
    for pt, name in SMOOTHED.items():
        w = getattr(block, name).weight * s[f"s_{pt}"][None, :]
        getattr(block, name).weight = fq_sym_dynamic(w) if quantize else w
    if quantize:
        block.conv1d.weight = fq_sym_dynamic(block.conv1d.weight)
        block.ssm.A_log, block.ssm.D = fq_sym_dynamic(block.ssm.A_log), fq_sym_dynamic(block.ssm.D)


def _identity(x):
    return x


def observe_scales(mode: ModeRecipe, bank, depth: int, vectors: list[dict]) -> tuple[list, list[dict]]:
    """Pass 2: the smoothed fp32 model (weights not quantized) with a running-max observer at each Q1 point."""
    blocks = _float_blocks(mode, bank, depth)
    observers = [{p: AmaxObserver() for p in Q1_POINTS} for _ in blocks]
    for block, obs, s in zip(blocks, observers, vectors):
        _smooth_weights(block, s, quantize=False)
        wrap_mamba1(block, _table(obs, s, obs["u"]))
    return blocks, observers


def build(mode: ModeRecipe, bank, stats: list[dict], depth: int, quantize: bool) -> list:
    """SmQ-SSM's blocks 0..depth (quantize=False: the smoothing alone, the +transform variant)."""
    blocks = _float_blocks(mode, bank, depth)
    for block, layer in zip(blocks, stats):
        s = {k: layer[k] for k in (f"s_{p}" for p in SMOOTHED)}
        _smooth_weights(block, s, quantize)
        if quantize:
            fns = {p: (lambda x, sc=layer[p]: fq_sym(x, sc)) for p in Q1_POINTS}
            wrap_mamba1(block, _table(fns, s, fns["u"]))
        else:
            fns = {p: _identity for p in Q1_POINTS}
            wrap_mamba1(block, _table(fns, s, _identity))
    return blocks
