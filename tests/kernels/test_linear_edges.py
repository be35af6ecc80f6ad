"""W8A8 linear details: the int32 GEMM by exact float blocks, exact under every fp32 matmul precision, at the
block boundary, and on CPUs whose oneDNN int8 kernel is wrong; bad orders."""
import pytest
import torch

from harness.kernels.linear import _EXACT_K, Epilogue, int8_gemm, int8_gemm_float, w8a8_linear
from harness.spec import FloatOut, QTensor, QuantOut, Rounding


@pytest.mark.parametrize("precision", ["highest", "high", "medium"])
def test_accumulation_is_exact_under_every_matmul_precision(precision):
    """With TF32/bf16 matmuls allowed, fp32 GEMMs are not exact: the fallback's float64 path must take over."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-128, 128, (3, 2100), generator=g, dtype=torch.int8)
    w = torch.randint(-128, 128, (5, 2100), generator=g, dtype=torch.int8)
    exact = (x.to(torch.int64) @ w.to(torch.int64).t()).to(torch.int32)
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision(precision)
        acc, fallback = int8_gemm(x, w), int8_gemm_float(x, w)
    finally:
        torch.set_float32_matmul_precision(old)
    assert acc.dtype == fallback.dtype == torch.int32 and torch.equal(acc, exact) and torch.equal(fallback, exact)


def test_block_size_keeps_partial_sums_exact():
    """_EXACT_K * 128 * 128 == 2**24: one more column per block and an all-extreme row would round."""
    assert _EXACT_K * 128 * 128 == 2 ** 24
    k = 1025
    x = torch.full((1, k), -128, dtype=torch.int8)
    w = torch.full((1, k), -128, dtype=torch.int8)
    x[0, -1], w[0, -1] = 127, 127   # the total 2**24 + 127 * 127 is odd: not representable in fp32
    assert int8_gemm_float(x, w).item() == int8_gemm(x, w).item() == 1024 * 128 * 128 + 127 * 127


@pytest.mark.parametrize("shape", [(1, 5, 3), (2, 3, 17, 9), (512, 1536, 80)])
def test_int32_gemm_equals_the_integer_product(shape):
    """The int8 GEMM keeps x's leading dimensions and gives the exact int32 product."""
    g = torch.Generator().manual_seed(1)
    *lead, k, n = shape
    x = torch.randint(-128, 128, (*lead, k), generator=g, dtype=torch.int8)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    exact = (x.to(torch.int64) @ w.to(torch.int64).t()).to(torch.int32)
    got = int8_gemm(x, w)
    assert got.shape == (*lead, n) and got.dtype == torch.int32 and torch.equal(got, exact)


_GEMM_PROBE = """
import numpy as np, torch
from harness.kernels.linear import int8_gemm
rng = np.random.default_rng(0)
x = torch.from_numpy(rng.integers(-128, 128, (80, 192)).astype(np.int8))
w = torch.from_numpy(rng.integers(-128, 128, (48, 192)).astype(np.int8))
print(torch.equal(int8_gemm(x, w).to(torch.int64), x.to(torch.int64) @ w.to(torch.int64).t()))
"""


@pytest.mark.parametrize("isa", ["AVX2", "AVX512_CORE"])
def test_int8_gemm_is_exact_where_onednn_has_no_vnni(isa):
    """oneDNN's int8 GEMM (torch._int_mm) is wrong without VNNI; DNNL_MAX_CPU_ISA makes this CPU take that path.
    The harness's GEMM must stay exact there (it did not while it used torch._int_mm)."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", _GEMM_PROBE], capture_output=True, text=True, cwd=root,
                         env={**os.environ, "DNNL_MAX_CPU_ISA": isa, "PYTHONPATH": str(root)}, check=True)
    assert out.stdout.strip() == "True"


def test_unknown_epilogue_order_is_refused():
    x = QTensor(torch.ones(1, 2, dtype=torch.int8), 0.1)
    w = QTensor(torch.ones(3, 2, dtype=torch.int8), 0.1)
    with pytest.raises(ValueError, match="unknown epilogue order 'both'; valid: \\['ratio_then_weight', 'weight_then_ratio'\\]"):
        w8a8_linear(x, w, "both", FloatOut(torch.float32))


def test_int8_output_must_round_half_even():
    x = QTensor(torch.ones(1, 2, dtype=torch.int8), 0.1)
    w = QTensor(torch.ones(3, 2, dtype=torch.int8), 0.1)
    with pytest.raises(AssertionError, match="round half to even"):
        w8a8_linear(x, w, Epilogue.RATIO_THEN_WEIGHT, QuantOut(0.1, Rounding.HALF_AWAY))


def test_float_output_uses_ratio_s_x_and_the_output_dtype():
    x = QTensor(torch.tensor([[3, -1]], dtype=torch.int8), 0.5)
    w = QTensor(torch.tensor([[1, 1], [2, 0]], dtype=torch.int8), 0.25)
    y = w8a8_linear(x, w, Epilogue.WEIGHT_THEN_RATIO, FloatOut(torch.float32))
    assert y.tolist() == [[0.25, 0.75]]    # acc (2, 6) * 0.25 * 0.5
    y16 = w8a8_linear(QTensor(x.codes, 0.1), w, Epilogue.WEIGHT_THEN_RATIO, FloatOut(torch.float16))
    assert torch.equal(y16, y16.half().float()) and y16.dtype == torch.float32


def test_saturating_outputs_match_the_oracle():
    """Outputs beyond 127 saturate in the kernel and in the oracle (a clamp to 128 would wrap to -128)."""
    from harness.kernels.linear import w8a8_linear_ref
    x = QTensor(torch.full((1, 4), 127, dtype=torch.int8), 0.5)
    w = QTensor(torch.tensor([[127, 127, 127, 127], [-128, -128, -128, -128], [1, 0, 0, 0]], dtype=torch.int8), 0.5)
    for order in Epilogue:
        got = w8a8_linear(x, w, order, QuantOut(0.25, Rounding.HALF_EVEN))
        ref = w8a8_linear_ref(x, w, order, QuantOut(0.25, Rounding.HALF_EVEN))
        assert got.codes.tolist() == ref.codes.tolist() == [[127, -128, 127]]


def test_float_fallback_blocks_the_last_dimension_of_any_input():
    """int8_gemm_float takes x (..., k) like int8_gemm: its blocks run over k, the last dimension (a mutant that
    took shape[1] survived: int8_gemm hands it 2-D inputs only, where the two are the same)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randint(-128, 128, (3, 1, 2100), generator=g, dtype=torch.int8)   # shape[1] = 1 < k = 2100
    w = torch.randint(-128, 128, (4, 2100), generator=g, dtype=torch.int8)
    exact = (x.to(torch.int64) @ w.to(torch.int64).t()).to(torch.int32)
    assert torch.equal(int8_gemm_float(x, w), exact)
