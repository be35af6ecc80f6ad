"""GPTQ with per-row symmetric scales (harness.emulation.gptq_channel): a grid per row, and less output error on
the Hessian's inputs than round-to-nearest at the same scales."""
import torch

from harness.emulation.gptq import Hessian
from harness.emulation.gptq_channel import gptq_channel
from harness.kernels.fakequant import fq_sym, sym_mse_scales


def test_gptq_is_on_the_row_grid_and_beats_rtn_on_correlated_inputs():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(4, 64, 160, generator=g) @ torch.randn(160, 160, generator=g) * 0.3  # correlated channels
    W = torch.randn(12, 160, generator=g)
    hess = Hessian(160)
    for seq in X:
        hess.add(seq[None])
    Q = gptq_channel(W, hess.H, 4)
    s = sym_mse_scales(W, 4)
    codes = Q / s
    assert torch.allclose(codes, codes.round(), atol=1e-4) and codes.min() >= -8 - 1e-4 and codes.max() <= 7 + 1e-4
    rtn = fq_sym(W, s, 4)
    x = X.reshape(-1, 160)
    err_gptq = (x @ (W - Q).T).pow(2).sum()
    err_rtn = (x @ (W - rtn).T).pow(2).sum()
    assert err_gptq < 0.7 * err_rtn


def test_a_dead_input_column_is_zeroed():
    g = torch.Generator().manual_seed(1)
    X = torch.randn(2, 32, 8, generator=g)
    X[..., 3] = 0
    hess = Hessian(8)
    hess.add(X)
    Q = gptq_channel(torch.randn(4, 8, generator=g), hess.H, 4)
    assert (Q[:, 3] == 0).all()
