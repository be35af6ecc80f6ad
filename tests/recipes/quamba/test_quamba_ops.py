"""prep=quamba pinned to Quamba's arithmetic on small seeded tensors (docs/fidelity.md).

Each test names the Quamba code it follows and uses inputs on which the
alternative the harness computed before (exact rotation, fp32 fold, one fp16 store,
z*sigmoid(z) gate, rsqrt, in_proj's epilogue order) gives different bits.
"""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from harness.architectures.mamba1.build import build_block
from harness.modes import CALIBRATION_RECIPES
from harness.recipes.registry import get_mode
from harness.kernels import portable
from harness.kernels.portable import sum_last
from harness.emulation.modules import EmuRMSNorm
from harness.kernels.conv1d import float_causal_conv1d_silu, silu_kernel
from harness.kernels.hadamard import (
    _base_matrix,
    hadamard_factors,
    hadamard_transform,
    hadamard_transform_fht,
    quamba_kernel_support,
)
from harness.kernels.linear import Epilogue, w8a8_linear
from harness.kernels.quant import round_to_dtype
from harness.kernels.scan import ScanOrder, selective_scan
from harness.spec import FloatOut, LayerScales, ModelDims, QTensor
from harness.runner.weightbank import WeightBank
from harness.architectures.mamba1.weights import fht_fp16, float_layer, quamba_fp16_layer, quamba_int8_layer

f16 = lambda t: round_to_dtype(t, torch.float16)  # noqa: E731


def _fht_oracle(row: np.ndarray, scale: float) -> np.ndarray:
    """fast_hadamard_transform_cuda.cu written out with numpy float32 scalars: butterflies (a+b, a-b) over
    the position bits from the lowest up (common.h:87-124), then per output the base matrix's terms
    summed left to right (special.h:12-28), then * scale (common.h:153)."""
    n = row.size
    b, m = hadamard_factors(n)
    x = [[np.float32(v) for v in row[c * m:(c + 1) * m]] for c in range(b)]
    stride = 1
    while stride < m:
        for c in range(b):
            for j in range(m):
                if j & stride == 0:
                    a, d = x[c][j], x[c][j + stride]
                    x[c][j], x[c][j + stride] = np.float32(a + d), np.float32(a - d)
        stride *= 2
    if b > 1:
        signs = _base_matrix(b).numpy()
        out = []
        for r in range(b):
            col = []
            for j in range(m):
                acc = np.float32(signs[r, 0] * x[0][j])
                for c in range(1, b):
                    acc = np.float32(acc + x[c][j]) if signs[r, c] > 0 else np.float32(acc - x[c][j])
                col.append(acc)
            out.append(col)
        x = out
    s = np.float32(scale)
    return np.array([np.float32(v * s) for c in range(b) for v in x[c]], dtype=np.float32)


@pytest.mark.parametrize("n", [16, 48, 192])
def test_fht_is_the_kernels_fp32_arithmetic(n):
    g = torch.Generator().manual_seed(n)
    x = f16(torch.randn(6, n, generator=g) * 3)
    got = hadamard_transform_fht(x)
    want = np.stack([_fht_oracle(r, 1.0 / math.sqrt(n)) for r in x.numpy()])
    assert np.array_equal(got.numpy(), want)


def test_fht_fp16_store_differs_from_the_exact_rotation_rounded_once():
    x = f16(torch.randn(400, 384, generator=torch.Generator().manual_seed(1)))
    kernel, exact = f16(hadamard_transform_fht(x)), f16(hadamard_transform(x))
    differ = int((kernel != exact).sum())
    assert 0 < differ < 0.01 * x.numel()  # rare 1-ulp fp16 differences, as spec notes §2.1a says


def _raw(d_model=48, d_inner=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"in_proj": torch.randn(2 * d_inner, d_model, generator=g) * 0.2,
            "norm_weight": torch.rand(d_model, generator=g) + 0.5,
            "out_proj": torch.randn(d_model, d_inner, generator=g) * 0.2,
            "conv_weight": torch.randn(d_inner, 4, generator=g), "conv_bias": torch.randn(d_inner, generator=g),
            "x_proj": torch.randn(20, d_inner, generator=g), "dt_proj": torch.randn(d_inner, 4, generator=g),
            "dt_bias": torch.randn(d_inner, generator=g), "A_log": torch.randn(d_inner, 8, generator=g),
            "D": torch.randn(d_inner, generator=g)}


def test_norm_fold_is_done_on_fp16_values():
    """fuse_ln_linear (modelutils_mamba.py:47-48) multiplies the fp16 model's weights, not the checkpoint's."""
    raw = _raw()
    fold16 = f16(f16(raw["in_proj"]).double() * f16(raw["norm_weight"]).double())
    fold32 = f16(raw["in_proj"].double() * raw["norm_weight"].double())
    assert (fold16 != fold32).any()
    layer = quamba_fp16_layer(raw)
    assert torch.equal(layer.in_proj, fht_fp16(fold16))
    assert not torch.equal(layer.in_proj, fht_fp16(fold32))
    assert layer.norm_weight is None


def test_out_proj_is_stored_in_fp16_after_each_transform():
    """fuse_hadamard (qLinearLayer.py:860-868): input transform, fp16 store, output transform on W.t(), fp16 store."""
    raw = _raw()
    w = f16(raw["out_proj"])
    twice = fht_fp16(fht_fp16(w).t()).t()
    once = f16(hadamard_transform_fht(hadamard_transform_fht(w).t()).t())
    assert (twice != once).any()
    layer = quamba_fp16_layer(raw)
    assert torch.equal(layer.out_proj, twice)
    # and the transform itself is the kernel's: row by row against the scalar oracle
    first = np.stack([_fht_oracle(r, 1 / math.sqrt(96)) for r in w.numpy()]).astype(np.float16)
    assert np.array_equal(fht_fp16(w).numpy(), first.astype(np.float32))


def test_int8_weights_are_quantized_from_the_quamba_fp16_weights():
    raw = _raw()
    q, exact = quamba_int8_layer(raw), float_layer(raw, True, torch.float16)
    assert isinstance(q.in_proj, QTensor) and isinstance(q.out_proj, QTensor)
    assert q.in_proj.scale == float(f16(quamba_fp16_layer(raw).in_proj).abs().max().half() / 127)
    assert not torch.equal(quamba_fp16_layer(raw).in_proj, exact.in_proj)
    assert torch.equal(q.conv_weight.codes, quamba_int8_layer(raw, rotate=False).conv_weight.codes)


def test_rms_norm_multiplies_by_one_over_sqrt():
    """Triton: rstd = 1 / tl.sqrt(var + eps) (triton/quant_norm.py:114), var = sum(x^2) / N over d_model, on
    the (batch, seqlen, d_model) stream (mutants that summed or divided over dim 1 survived a 2-D input).
    The sum is the fixed pairwise one and the sqrt correctly rounded (the same on every CPU): checked
    against float64, where the correctly rounded sqrt of the fp32 var is exact to compute."""
    r = torch.randn(2, 64, 48, generator=torch.Generator().manual_seed(2)) * 3
    var = sum_last(r * r) / 48
    rstd = 1.0 / (var + 1e-5).double().sqrt().float()
    quamba = EmuRMSNorm(None, 1e-5, FloatOut(torch.float32))(r)
    assert torch.equal(quamba, r * rstd)
    # over d_model, not dim 1; and the pairwise sum, not a sequential one: both change bits here
    assert not torch.equal(quamba, r * (1.0 / ((r * r).sum(1, keepdim=True) / 64 + 1e-5).double().sqrt().float()))
    seq = r[..., :1] * r[..., :1]
    for i in range(1, 48):
        seq = seq + r[..., i:i + 1] * r[..., i:i + 1]
    assert not torch.equal(quamba, r * (1.0 / (seq / 48 + 1e-5).double().sqrt().float()))


def _fork_scan(u, delta, A_log, B, C, D, z, bias):
    """selective_scan_SE.py:129-273 written out: (B, D, L) layout, per step, .sum(dim=2), y * F.silu(z).

    With the emulation's portable functions: exp, log1p and silu from harness.kernels.portable, and the
    sum over d_state (contiguous) in its fixed pairwise order: the bits the fork's order gives on any CPU."""
    u, delta, z = (t.transpose(1, 2) for t in (u, delta, z))          # (B, D, L)
    B, C = B.transpose(1, 2), C.transpose(1, 2)                       # (B, N, L)
    delta = delta + bias[None, :, None]
    delta = torch.where(delta <= 20.0, portable.log1p(portable.exp(delta)), delta)
    A = -portable.exp(A_log)
    x = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        delta_i, u_i = delta[:, :, i], u[:, :, i]
        deltaA_i = portable.exp(delta_i.unsqueeze(2) * A.unsqueeze(0))
        deltaB_u_i = delta_i.unsqueeze(2) * B[:, :, i].unsqueeze(1) * u_i.unsqueeze(2)
        x = deltaA_i * x + deltaB_u_i
        ys.append(sum_last(x * C[:, :, i].unsqueeze(1))[..., 0])
    y = torch.stack(ys, dim=2) + u * D.unsqueeze(0).unsqueeze(2)
    return (y * portable.silu(z)).transpose(1, 2)


def test_torch_order_is_the_forks_pytorch_scan_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    bsz, L, E, N = 2, 23, 32, 16
    ops = (torch.randn(bsz, L, E, generator=g), torch.randn(bsz, L, E, generator=g) * 0.5 - 1,
           torch.randn(E, N, generator=g), torch.randn(bsz, L, N, generator=g), torch.randn(bsz, L, N, generator=g),
           torch.rand(E, generator=g) + 0.5, torch.randn(bsz, L, E, generator=g) * 3, torch.randn(E, generator=g) * 0.1)
    y, _ = selective_scan(*ops[:7], delta_bias=ops[7], order=ScanOrder.TORCH, out=FloatOut(torch.float32))
    want = _fork_scan(*ops)
    assert torch.equal(y, want)
    old, _ = selective_scan(*ops[:7], delta_bias=ops[7], order=ScanOrder.REFERENCE, out=FloatOut(torch.float32))
    assert not torch.equal(old, want)  # z * sigmoid(z) and the sequential sum give other bits


def test_gate_formulas_differ_where_silu_differs():
    z = torch.randn(4096, generator=torch.Generator().manual_seed(4)) * 4
    assert (portable.silu(z) != z * portable.sigmoid(z)).any()


def test_calibration_conv_rounds_to_fp16_before_silu():
    """qMambaLayer.py:105-106: the fp16 nn.Conv1d output, then SiLU, in Quamba's calibration model."""
    v = torch.linspace(-6, 6, 20001)
    once = f16(silu_kernel(v))
    twice = f16(silu_kernel(f16(v)))
    assert (once != twice).any()
    w = torch.zeros(1, 4)
    w[0, 3] = 1.0  # the current token only: the conv output is x itself
    x = v.reshape(1, -1, 1)
    got = float_causal_conv1d_silu(x, w, None, FloatOut(torch.float16), pre_silu=torch.float16)
    assert torch.equal(got.flatten(), twice)
    assert not torch.equal(float_causal_conv1d_silu(x, w, None, FloatOut(torch.float16)).flatten(), twice)
    # the block's module hands its pre_silu to the op (a mutant that dropped it survived)
    from harness.emulation.modules import ConvInput, EmuConv1d
    module = EmuConv1d(w, None, ConvInput("float"), FloatOut(torch.float16), torch.float16)
    assert torch.equal(module(x).flatten(), twice)


def test_mode3_float_in_proj_uses_the_w8a8b16o16_epilogue():
    """W8A8B16O16Linear.forward (qLinearLayer.py:806-820): weight scale first, then the input scale."""
    g = torch.Generator().manual_seed(5)
    x = QTensor(torch.randint(-128, 128, (64, 48), generator=g, dtype=torch.int8), 0.0123)
    w = QTensor(torch.randint(-127, 128, (96, 48), generator=g, dtype=torch.int8), 0.00731)
    out = FloatOut(torch.float16)
    first_w, first_r = (w8a8_linear(x, w, o, FloatOut(torch.float32))
                        for o in (Epilogue.WEIGHT_THEN_RATIO, Epilogue.RATIO_THEN_WEIGHT))
    assert not torch.equal(first_w, first_r)
    first_w = w8a8_linear(x, w, Epilogue.WEIGHT_THEN_RATIO, out)
    acc = x.codes.double() @ w.codes.double().t()
    want = f16(torch.tensor(0.0123, dtype=torch.float32) * (torch.tensor(0.00731, dtype=torch.float32) * acc.float()))
    assert torch.equal(first_w, want)


def _block(recipe, calibration=False):
    dims = ModelDims(d_model=48, d_inner=96, d_state=8, d_conv=4, dt_rank=4, n_layer=1, vocab_size=10, norm_eps=1e-5)
    raw = _raw()
    p = quamba_int8_layer(raw) if recipe.weights == "int8" else quamba_fp16_layer(raw)
    scales = LayerScales(*([0.01] * 7))
    return build_block(recipe, p, scales, dims, 0, calibration)


@pytest.mark.parametrize("mode,order,in_order", [
    ("0", ScanOrder.KERNEL, Epilogue.RATIO_THEN_WEIGHT),
    ("2-1", ScanOrder.TORCH, Epilogue.RATIO_THEN_WEIGHT),
    ("3", ScanOrder.TORCH, Epilogue.WEIGHT_THEN_RATIO),
])
def test_built_in_quantized_modes_take_quambas_op_order(mode, order, in_order):
    block = _block(get_mode(mode))
    assert (block.ssm.order, block.in_proj.order, block.had.fht) == (order, in_order, True)


def test_calibration_model_of_prep_quamba():
    block = _block(CALIBRATION_RECIPES["quamba"], calibration=True)
    assert block.ssm.order is ScanOrder.MAMBA and block.conv1d.pre_silu is torch.float16
    assert block.conv1d.out == FloatOut(torch.float16) and block.had.fht
    exact = _block(CALIBRATION_RECIPES["exact"], calibration=True)
    assert exact.ssm.order is ScanOrder.REFERENCE and exact.conv1d.pre_silu is None and not exact.had.fht


def test_mamba_order_is_the_kernel_order_with_mamba_ssms_gate(monkeypatch):
    """mamba_ssm selective_scan_fwd_kernel.cuh:158-298: D*u first, FMA per state, then out *= z / (1 + expf(-z))."""
    import harness.kernels.scan as scan_mod
    g = torch.Generator().manual_seed(6)
    bsz, L, E, N = 1, 9, 16, 4
    ops = [torch.randn(bsz, L, E, generator=g), torch.randn(bsz, L, E, generator=g), torch.randn(E, N, generator=g),
           torch.randn(bsz, L, N, generator=g), torch.randn(bsz, L, N, generator=g), torch.rand(E, generator=g),
           torch.randn(bsz, L, E, generator=g) * 3, torch.randn(E, generator=g)]
    y = torch.randn(4096, generator=g)
    z = torch.randn(4096, generator=g) * 4
    mamba = scan_mod._gate(y, z, ScanOrder.MAMBA)
    assert torch.equal(mamba, y * (z / (portable.exp(-z) + 1.0)))
    assert not torch.equal(mamba, scan_mod._gate(y, z, ScanOrder.KERNEL))
    monkeypatch.setattr(scan_mod, "_gate", lambda y, z, order: y)  # the same ungated arithmetic as KERNEL
    ungated = [selective_scan(*ops[:7], delta_bias=ops[7], order=o, out=FloatOut(torch.float32))[0] for o in (ScanOrder.MAMBA, ScanOrder.KERNEL)]
    assert torch.equal(*ungated)


@pytest.mark.parametrize("n,ok", [(16, True), (48, True), (192, True), (384, True), (768, True), (1536, True),
                                  (160, True), (640, True), (40960, True),
                                  (24, False), (96, False), (320, False), (20, False), (28 * 4, False), (4, False)])
def test_hadamard_widths_quamba_supports(n, ok):
    """The 40N kernel's widths too (a mutant that divided by 41 survived while only 320 was checked)."""
    assert (quamba_kernel_support(n) is None) == ok


def test_hadamard_width_messages_name_the_launcher_range():
    """Each refusal says which log_N the kernel's launcher reaches (12N/40N: 2, 4..10; power of two: 3..15)."""
    assert quamba_kernel_support(96).endswith("reaches log_N 2, 4..10, so it never launches it")
    assert quamba_kernel_support(4).endswith("reaches log_N 3..15, so it zero-pads it to a wider transform")
    assert quamba_kernel_support(40 * 2048).endswith("reaches log_N 2, 4..10, so it never launches it")


def test_weight_bank_prep_and_refusal(tmp_path):
    from conftest import make_hf_model, write_hf_dir
    from harness.checkpoints.loading import open_checkpoint
    bank = WeightBank(open_checkpoint(write_hf_dir(tmp_path / "m", make_hf_model(d_model=48, n_layer=1, seed=2))))
    q = bank.layer(0, "int8", True, "quamba")
    assert torch.equal(q.in_proj.codes, quamba_int8_layer(bank.raw(0)).in_proj.codes)
    assert not torch.equal(q.in_proj.codes, bank.layer(0, "int8", True, "exact").in_proj.codes)
    with pytest.raises(ValueError, match="prep=exact"):
        bank.layer(0, "fp32", True, "quamba")
    ids = torch.arange(4096).reshape(1, 4096)  # every row: the kernel's fp32 butterflies differ from the exact
    emb = bank.embed(ids, True, torch.float16, "quamba")  # transform in 9 of these 196608 fp16 values
    assert torch.equal(emb, fht_fp16(bank.ckpt.embedding()[ids].float()))
    assert not torch.equal(emb, bank.embed(ids, True, torch.float16, "exact"))  # (a mutant that took it survived)


@pytest.mark.parametrize("n, message", [
    (12 * 2048, "the 12N kernel does not transform width 24576: log_N = 11, its launcher reaches log_N 2, 4..10, "
                "so it never launches it"),
    (40 * 2048, "the 40N kernel does not transform width 81920: log_N = 11, its launcher reaches log_N 2, 4..10, "
                "so it never launches it"),
    (2 ** 16, "the power-of-two kernel does not transform width 65536: log_N = 16, its launcher reaches log_N 3..15, "
              "so it never launches it"),
    (36, "get_had_fn rejects width 36: it picks the 12N kernel and asserts 3 is a power of two"),
    (6, "get_had_fn rejects width 6: not 12*2^k, 40*2^k or a power of two"),
])
def test_hadamard_width_messages_whole(n, message):
    """Each message whole, one past the top of each launcher's range and each rejection (mutants that renamed a
    kernel, reached one log_N further or swapped the two rejections survived the endings checked above)."""
    assert quamba_kernel_support(n) == message


def test_an_unrotated_mode_keeps_its_norm_weight():
    """Mode 1 (no rotation) multiplies by the RMSNorm weight, which rotated modes fold into in_proj
    (a mutant that built the norm without its weight survived the unit tests)."""
    dims = ModelDims(d_model=48, d_inner=96, d_state=8, d_conv=4, dt_rank=4, n_layer=1, vocab_size=10, norm_eps=1e-5)
    p = float_layer(_raw(), False, torch.float16)
    block = build_block(get_mode("1"), p, None, dims, 0)
    assert block.norm.weight is p.norm_weight and not torch.all(p.norm_weight == 1)
    assert _block(get_mode("0")).norm.weight is None
