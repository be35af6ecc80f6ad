"""GPTQ with one symmetric scale per output row (QuaRot's and MambaQuant's GPTQ.fasterquant with groupsize -1,
percdamp 0.01, no act-order: MambaQuant/MambaQuant@a4803c4 quantize/gptq.py:442-520, called at :1281-1285): the
scales are found once on the whole weight (kernels.fakequant.sym_mse_scales) before the columns are quantized in
order, each column's error divided by Hinv[i, i] fed to the later columns of its 128-column block, then the
block's errors to the later blocks. H comes from emulation.gptq.Hessian (the same add_batch)."""
from __future__ import annotations

import torch

from ..kernels.fakequant import fq_sym, sym_mse_scales

__all__ = ["gptq_channel"]

BLOCK = 128  # fasterquant's blocksize


def _hinv(H: torch.Tensor, W: torch.Tensor, percdamp: float) -> torch.Tensor:
    H = H.clone().to(torch.float32)
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    idx = torch.arange(H.shape[0])
    H[idx, idx] += percdamp * torch.mean(torch.diag(H))
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)


def gptq_channel(weight: torch.Tensor, H: torch.Tensor, bits: int, percdamp: float = 0.01) -> torch.Tensor:
    """weight (out, in), H (in, in) -> the fake-quantized weight (out, in) fp32, on a per-row symmetric grid."""
    W = weight.clone().to(torch.float32)
    scale = sym_mse_scales(W, bits)
    Hinv = _hinv(H, W, percdamp)
    Q = torch.zeros_like(W)
    n = W.shape[1]
    for i1 in range(0, n, BLOCK):
        i2 = min(i1 + BLOCK, n)
        W1, Err1, Hinv1 = W[:, i1:i2].clone(), torch.zeros_like(W[:, i1:i2]), Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            w, d = W1[:, i], Hinv1[i, i]
            q = fq_sym(w[:, None], scale, bits)[:, 0]
            Q[:, i1 + i] = q
            err = (w - q) / d
            W1[:, i:] -= err[:, None] @ Hinv1[i, i:][None, :]
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    return Q
