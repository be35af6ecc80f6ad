"""The naive W8A8 baselines' blocks (docs/field-recipes.md "Naive W8A8"): the architecture's fp32 blocks with
fake quantizers at the points the upstream code quantizes (emulation.fakequant).

* naive-static, Quamba1's simulated path with no flags (enyac-group/Quamba@624361b, ``python main.py <model> fake``;
  the notes §1.1): weights 8-bit per-tensor symmetric absmax (quantUtils.py:26-47; in_proj, x_proj, dt_proj,
  out_proj, conv1d, A_log and D: qLinearLayer.py:53-68, qConvLayer.py:78-88, qSelectiveScan.py:57-73, 114-124;
  biases stay fp), activations static per-tensor symmetric at 9 points per block (qMambaLayer.py:90-99,
  qSelectiveScan.py:41), scale max|x| / 127 from a running max over the calibration (observer.py:30-68).
  Mamba-2 (no upstream: Quamba1 has no Mamba-2) takes the same rule at its in_proj input, in_proj's z, xBC and
  dt outputs, the conv's x, B and C outputs and out_proj's input; its weights in_proj, conv1d, out_proj, A_log, D.
* naive-dynamic, PTQ-SSM's W8A8Linear (mikequ1/PTQ-SSM@67d764b smoothquant/smoothquant/fake_quant.py:104-108,
  183-219): each of the block's linear layers (Mamba-1: in_proj, x_proj, dt_proj, out_proj; Mamba-2: in_proj,
  out_proj) computes fq(F.linear(fq(x), fq(W)) + b) with every scale max|.| / 127 of that call's whole tensor, RNE,
  no clamp (:7-46); conv, scan, norms stay fp.

The blocks run in fp32 (the upstream models are fp16): the harness compares recipes, not fp16 rounding.

On a hybrid (Bamba / Granite 4.0-H, Nemotron-H) both recipes quantize the Mamba-2 blocks as on Mamba-2; the attention
and MLP blocks stay the unrotated fp32 float blocks (neither upstream has an attention layer to quantize).
"""
from __future__ import annotations

import torch

from ...architectures.bamba.build import is_ssm_block
from ...architectures.registry import get_architecture
from ...emulation.fakequant import AmaxObserver, split_last, wrap_mamba1, wrap_mamba2
from ...kernels.fakequant import fq_sym, fq_sym_dynamic
from ...modes import ModeRecipe

__all__ = ["STATIC_POINTS", "static_points", "build_static", "build_dynamic", "observe_static", "float_blocks",
           "static_scale"]

_AMAX_FLOOR = 1e-5

# Quamba1's QAct names -> (architecture, this harness's point, slice of the point's last dim or None)
STATIC_POINTS: dict[str, tuple[str, ...]] = {
    "mamba1": ("mamba_in", "conv_in", "z", "u", "dt_proj_in", "dt", "B", "C", "ssm_out"),
    "mamba2": ("mamba_in", "z", "xBC", "dt", "x", "B", "C", "ssm_out"),
}


def float_blocks(mode: ModeRecipe, bank, depth: int) -> list:
    """The architecture's own fp32 blocks 0..depth of `mode`'s knobs (fp32, no rotation)."""
    return get_architecture(bank.dims.architecture).build_blocks(mode, bank, None, depth, False)


def _static(scale: float):
    return lambda x: fq_sym(x, scale)


def static_points(dims, fns: dict[str, object]) -> dict[str, object]:
    """Quamba1's point names (with their functions) -> the block's points (emulation.fakequant)."""
    if dims.architecture == "mamba1":
        return {"in_proj.in": fns["mamba_in"], "conv.in": fns["conv_in"], "scan.z": fns["z"], "conv.out": fns["u"],
                "dt_proj.in": fns["dt_proj_in"], "dt_proj.out": fns["dt"], "scan.B": fns["B"], "scan.C": fns["C"],
                "out_proj.in": fns["ssm_out"]}
    gs = dims.ngroups * dims.d_state
    return {"in_proj.in": fns["mamba_in"],
            "in_proj.out": split_last([dims.d_inner, dims.conv_dim, dims.nheads], [fns["z"], fns["xBC"], fns["dt"]]),
            "conv.out": split_last([dims.d_inner, gs, gs], [fns["x"], fns["B"], fns["C"]]),
            "out_proj.in": fns["ssm_out"]}


def _wrap(block, dims, table):
    return (wrap_mamba1 if dims.architecture == "mamba1" else wrap_mamba2)(block, table)


def _ssm(bank) -> tuple[object, list[bool]]:
    """The Mamba blocks' dims (a hybrid's Mamba-2 ones) and, per block, whether the recipe quantizes it."""
    dims = bank.dims
    ssm = dims.ssm_dims() if hasattr(dims, "ssm_dims") else dims
    return ssm, [is_ssm_block(dims, i) for i in range(dims.n_layer)]


def _quantize_weights(block, dims, fq) -> None:
    """Every weight the recipe quantizes, replaced by a new tensor (the bank's are shared: never written)."""
    names = ("in_proj", "x_proj", "dt_proj", "out_proj") if dims.architecture == "mamba1" else ("in_proj", "out_proj")
    for name in names:
        getattr(block, name).weight = fq(getattr(block, name).weight)
    block.conv1d.weight = fq(block.conv1d.weight)
    ssm = block.ssm if dims.architecture == "mamba1" else block.ssd
    ssm.A_log, ssm.D = fq(ssm.A_log), fq(ssm.D)


def build_static(mode: ModeRecipe, bank, scales: list[dict], depth: int) -> list:
    """naive-static: per-tensor absmax weights, static per-tensor activations at the calibrated scales."""
    dims, quantized = _ssm(bank)
    blocks = float_blocks(mode, bank, depth)
    for block, layer, q in zip(blocks, scales, quantized):
        if not q:
            continue
        _quantize_weights(block, dims, fq_sym_dynamic)
        _wrap(block, dims, static_points(dims, {p: _static(layer[p]) for p in STATIC_POINTS[dims.architecture]}))
    return blocks


def observe_static(mode: ModeRecipe, bank, depth: int) -> tuple[list, list[dict[str, AmaxObserver]]]:
    """The calibration model of naive-static: the fp32 blocks with a running-max observer at each point."""
    dims, quantized = _ssm(bank)
    blocks = float_blocks(mode, bank, depth)
    observers = [{p: AmaxObserver() for p in STATIC_POINTS[dims.architecture]} if q else {}
                 for _, q in zip(blocks, quantized)]
    for block, obs in zip(blocks, observers):
        if obs:
            _wrap(block, dims, static_points(dims, obs))
    return blocks, observers


def static_scale(amax: float) -> float:
    """max|x|.clamp(1e-5) / 127 in fp32 (observer.py:14-28)."""
    return float(torch.tensor(max(amax, _AMAX_FLOOR), dtype=torch.float32) / 127)


def _dyn(x: torch.Tensor) -> torch.Tensor:
    return fq_sym_dynamic(x, clamp=False)


def build_dynamic(mode: ModeRecipe, bank, depth: int) -> list:
    """naive-dynamic: PTQ-SSM's W8A8Linear at every linear layer of the block (dt_proj's output is quantized with
    its bias, which the block adds in the scan: fq(x + b) - b)."""
    dims, quantized = _ssm(bank)
    blocks = float_blocks(mode, bank, depth)
    for block in (b for b, q in zip(blocks, quantized) if q):
        names = ("in_proj", "x_proj", "dt_proj", "out_proj") if dims.architecture == "mamba1" else ("in_proj", "out_proj")
        table = {}
        for name in names:
            getattr(block, name).weight = fq_sym_dynamic(getattr(block, name).weight, clamp=False)
            table[f"{name}.in"], table[f"{name}.out"] = _dyn, _dyn
        if dims.architecture == "mamba1":
            bias = block.ssm.dt_bias
            table["dt_proj.out"] = lambda x, b=bias: _dyn(x + b) - b
        _wrap(block, dims, table)
    return blocks
