"""Quamba2's W8A8 on a hybrid SSM-attention model (spec.HybridDims: Bamba, Granite 4.0-H): its Mamba-2 blocks are
Quamba2's blocks (build.build_q2_mamba2_block, with the scales calibrate.calibrate_quamba2 observes on the whole
rotated fp16 model), its attention and MLP blocks stay in rotated fp16 (weights and every output rounded to fp16,
architectures.bamba.build.float_block): Quamba2 has no attention or MLP recipe, and the residual stream they share
with the Mamba-2 blocks is rotated (Had_D), as Quamba2 rotates it."""
from __future__ import annotations

from ....architectures.bamba.build import float_block, is_ssm_block, w8a8_block
from ....modes import Q2_CALIBRATION_RECIPE, ModeRecipe
from .build import build_q2_mamba2_block
from .calibration import ssm_dims

__all__ = ["build_q2_hybrid_blocks", "HYBRID_FLOAT_RECIPE"]

HYBRID_FLOAT_RECIPE = Q2_CALIBRATION_RECIPE  # rotated fp16 weights and activations: the attention and MLP blocks


def build_q2_hybrid_blocks(recipe: ModeRecipe, bank, scales: list, depth: int, calibration: bool = False, *,
                           linear_kv: str | None = None) -> list:
    """Blocks 0..depth: Quamba2's W8A8 Mamba-2 blocks from the float model's tensors and their calibrated scales;
    the attention and MLP blocks in rotated fp16, or with linear_kv (a KV cache format, q2.linear.KV_FORMATS) under
    the W8A8 linear recipe at their calibrated scales (q2.linear.LinearScales)."""
    dims = bank.dims

    def other(i: int):
        if linear_kv is None:
            return float_block(HYBRID_FLOAT_RECIPE, bank.raw(i), dims, i)
        return w8a8_block(HYBRID_FLOAT_RECIPE, bank.raw(i), dims, i, scales[i], linear_kv)
    return [build_q2_mamba2_block(recipe, bank.raw(i), scales[i], ssm_dims(dims), i) if is_ssm_block(dims, i)
            else other(i) for i in range(depth + 1)]
