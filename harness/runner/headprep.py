"""The lm_head of a float recipe prepared and applied block by block: the same bits as the whole-tensor formulas,
without whole copies of a 50280 x d_model head or of (seq, 50280) logits (docs/performance.md "Mamba-2")."""
from __future__ import annotations

import torch

from ..kernels.hadamard import hadamard_transform
from ..kernels.quant import round_to_dtype

__all__ = ["rotated_head", "round_rows_"]


_HEAD_ROWS = 4096  # rows of the head folded and rotated at a time


def rotated_head(w: torch.Tensor, norm_w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """round(Had(round(round(w) * norm_w))) in `dtype` (fp32 values), (vocab, d_model), w the checkpoint's head (any
    float dtype), in blocks of rows: every op is elementwise within a row, so the bits are those of one pass over
    the head, without its copies (an unrotated one in dtype, three 309 MB float64 ones for a 50280 x 768 head)."""
    out = torch.empty(w.shape, dtype=torch.float32)
    norm64 = norm_w.to(torch.float64)
    for start in range(0, w.shape[0], _HEAD_ROWS):
        rows = round_to_dtype(w[start:start + _HEAD_ROWS].to(torch.float32), dtype)
        folded = round_to_dtype(rows.to(torch.float64) * norm64, dtype)
        out[start:start + _HEAD_ROWS] = round_to_dtype(hadamard_transform(folded), dtype)
    return out


_ROUND_ROWS = 64  # positions of the logits rounded at a time


def round_rows_(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """kernels.quant.round_to_dtype(y, dtype) written into y (fp32, (..., n)), a block of rows at a time: the same
    bits (a conversion is elementwise) without the fp16 and fp32 copies of a (seq, 50280) logits tensor."""
    if dtype == torch.float32:
        return y
    rows = y.view(-1, y.shape[-1])
    for start in range(0, rows.shape[0], _ROUND_ROWS):
        block = rows[start:start + _ROUND_ROWS]
        block.copy_(block.to(dtype))
    return y
