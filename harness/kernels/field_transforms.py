"""The exact transforms of the field's other recipes (docs/field-recipes.md): SmoothQuant's smoothing factors,
random-sign Hadamard matrices and the KLT (covariance eigenbasis), each with a ``*_ref`` twin.

* ``smooth_factors``: s_c = (a_c^alpha / w_c^(1 - alpha)).clamp(floor), w_c = max_o |W[o, c]|.clamp(1e-5)
  (enyac-group/Quamba@624361b quamba/fake_quant/smooth_quant_utils.py:75-89, floor 1e-5; MambaQuant@a4803c4
  model_llm/tests/quant_naive.py:588-644 uses alpha 0.5 and floor 1e-2);
* ``random_hadamard``: diag(+-1) @ Had_n (MambaQuant quantize/hadmard.py:11-68: a random sign diagonal times
  the normalized Walsh-Hadamard matrix, with QuaRot's 12/20/28/40... factorizations: kernels.hadamard). The
  signs come from a seeded generator, so runs repeat (the upstream draws them from the global torch RNG);
* ``klt``: the eigenvectors (columns) of a float64 covariance, eigenvalues ascending as torch.linalg.eigh
  gives them (MambaQuant quantize/get_klt_matrix.py:305-363); each column's sign is fixed so that its entry
  of largest magnitude is positive (LAPACK and cuSOLVER may return either sign: the notes §4d).
"""
from __future__ import annotations

import torch

from .hadamard import hadamard_matrix

__all__ = ["quantile_rows", "quantile_rows_ref", "smooth_factors", "smooth_factors_ref", "random_hadamard", "random_hadamard_ref", "covariance",
           "klt", "klt_ref", "TransformError"]


class TransformError(ValueError):
    """A statistic a transform cannot be made from (a covariance that is not finite)."""


def quantile_rows(x: torch.Tensor, q: float) -> torch.Tensor:
    """Per row of x (rows, n) the q-quantile with torch.quantile's linear interpolation, by a sort (torch.quantile
    refuses inputs of more than 2^24 values; MambaQuant's S3/S4 statistic, smoothquant_get_matmul_scale.py:392-488)."""
    v, _ = x.to(torch.float64).sort(dim=1)
    n = v.shape[1]
    pos = q * (n - 1)
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    return (v[:, lo] + (v[:, hi] - v[:, lo]) * (pos - lo)).to(torch.float32)


def quantile_rows_ref(x: torch.Tensor, q: float) -> torch.Tensor:
    return torch.quantile(x.to(torch.float64), q, dim=1).to(torch.float32)


def smooth_factors(act_amax: torch.Tensor, weight: torch.Tensor, alpha: float, floor: float = 1e-5) -> torch.Tensor:
    """Per input channel c of `weight` (out, in): (a_c^alpha / w_c^(1 - alpha)).clamp(floor), fp32."""
    w = weight.abs().amax(dim=0).clamp(min=1e-5).to(torch.float64)
    a = act_amax.to(torch.float64)
    return (a.pow(alpha) / w.pow(1 - alpha)).clamp(min=floor).to(torch.float32)


def smooth_factors_ref(act_amax: torch.Tensor, weight: torch.Tensor, alpha: float, floor: float = 1e-5) -> torch.Tensor:
    out = []
    for c in range(weight.shape[1]):
        w = max(max(abs(v) for v in weight[:, c].tolist()), 1e-5)
        out.append(max(float(act_amax[c]) ** alpha / w ** (1 - alpha), floor))
    return torch.tensor(out, dtype=torch.float32)


def random_hadamard(n: int, seed: int) -> torch.Tensor:
    """(n, n) float64 orthogonal matrix diag(signs) @ Had_n, the signs +-1 drawn from torch.Generator(seed)."""
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (n,), generator=gen, dtype=torch.int64).to(torch.float64) * 2 - 1
    return signs[:, None] * hadamard_matrix(n)


def random_hadamard_ref(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (n,), generator=gen, dtype=torch.int64).tolist()
    h = hadamard_matrix(n)
    return torch.stack([h[i] * (2 * signs[i] - 1) for i in range(n)])


def covariance(x: torch.Tensor) -> torch.Tensor:
    """torch.cov of the rows of x (tokens, channels) in float64 (get_klt_matrix.py:310-312); a TransformError
    when it is not finite (one token: torch.cov divides by tokens - 1 = 0)."""
    x = x.reshape(-1, x.shape[-1]).to(torch.float64)
    if x.shape[0] < 2:
        raise TransformError(f"a covariance needs at least 2 tokens, got {x.shape[0]}: give more calibration "
                             f"tokens (--calib_samples x --calib_seqlen >= 2)")
    cov = torch.cov(x.T)
    if not bool(torch.isfinite(cov).all()):
        raise TransformError("the activation covariance is not finite (NaN or inf in the calibration activations)")
    return cov


def klt(cov: torch.Tensor) -> torch.Tensor:
    """The eigenvectors of `cov` as columns (eigenvalues ascending), float64, each column's largest-magnitude
    entry made positive; a TransformError for a covariance that is not finite."""
    if not bool(torch.isfinite(cov).all()):
        raise TransformError("the activation covariance is not finite: no KLT can be made from it")
    _, k = torch.linalg.eigh(cov.to(torch.float64))
    idx = k.abs().argmax(dim=0)
    signs = torch.sign(k[idx, torch.arange(k.shape[1])])
    return k * torch.where(signs == 0, torch.ones_like(signs), signs)


def klt_ref(cov: torch.Tensor) -> torch.Tensor:
    _, k = torch.linalg.eigh(cov.to(torch.float64))
    cols = []
    for j in range(k.shape[1]):
        col = k[:, j]
        big = max(range(col.shape[0]), key=lambda i: abs(float(col[i])))
        cols.append(col if float(col[big]) >= 0 else -col)
    return torch.stack(cols, dim=1) if cols else k
