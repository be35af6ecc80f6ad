"""The field recipes' fake quantizers (harness.kernels.fakequant) on crafted tensors, against written-out values
and against their element-by-element *_ref twins."""
import pytest
import torch

from harness.kernels.fakequant import (absmax_scale, asym_params, fq_asym, fq_asym_ref, fq_asym_rows, fq_asym_rows_ref,
                                       fq_sym, fq_sym_dynamic, fq_sym_dynamic_ref, fq_sym_ref, fq_sym_rows,
                                       fq_sym_rows_ref, percentile_clip_rows)


def test_fq_sym_rounds_half_to_even_and_saturates():
    x = torch.tensor([0.25, 0.75, -0.25, 1.25, 200.0, -300.0, 0.0])
    # scale 0.5: x / s = 0.5, 1.5, -0.5, 2.5, 400, -600, 0 -> RNE 0, 2, -0, 2, clamp 127, -128, 0
    assert fq_sym(x, 0.5).tolist() == [0.0, 1.0, -0.0, 1.0, 63.5, -64.0, 0.0]
    assert fq_sym(x, 0.5, clamp=False).tolist() == [0.0, 1.0, -0.0, 1.0, 200.0, -300.0, 0.0]
    assert fq_sym(torch.tensor([9.0, -9.0]), 1.0, bits=4).tolist() == [7.0, -8.0]
    assert torch.equal(fq_sym(x, 0.5), fq_sym_ref(x, 0.5))


def test_absmax_scale_and_dynamic_per_tensor():
    x = torch.tensor([[1.0, -2.54], [0.3, 0.0]])
    s = absmax_scale(x)
    assert s == pytest.approx(2.54 / 127, rel=1e-7)
    out = fq_sym_dynamic(x)
    assert out[0, 1].item() == pytest.approx(-2.54, rel=1e-6)          # the absmax value is code -127 exactly
    assert out[0, 0].item() == pytest.approx(50 * s, rel=1e-6)         # 1.0 / 0.02 = 50
    assert out[1, 0].item() == pytest.approx(15 * s, rel=1e-6)         # 0.3 / 0.02 = 15
    assert absmax_scale(torch.zeros(3)) == pytest.approx(1e-5 / 127)  # the 1e-5 floor: zeros stay zeros
    assert torch.equal(fq_sym_dynamic(torch.zeros(3)), torch.zeros(3))
    g = torch.Generator().manual_seed(1)
    y = torch.randn(3, 5, generator=g) * 3
    assert torch.equal(fq_sym_dynamic(y), fq_sym_dynamic_ref(y))
    assert torch.equal(fq_sym_dynamic(y, clamp=False), fq_sym_dynamic_ref(y, clamp=False))


def test_fq_sym_rows_has_one_scale_per_output_row():
    w = torch.tensor([[1.0, -0.6, 0.26], [10.0, 3.0, -1.0]])
    out = fq_sym_rows(w, 4)  # 4 bits: s = amax / 7 per row
    assert out[0].tolist() == pytest.approx([1.0, -4 / 7, 2 / 7], rel=1e-6)
    assert out[1].tolist() == pytest.approx([10.0, 20 / 7, -10 / 7], rel=1e-6)
    assert torch.equal(out, fq_sym_rows_ref(w, 4))


def test_asymmetric_quantizer_written_out():
    # range [-1, 3] at 8 bits: scale 4/255, zero point RNE(1 / (4/255)) = RNE(63.75) = 64
    scale, zp = asym_params(torch.tensor(-1.0), torch.tensor(3.0), 8)
    assert scale.item() == pytest.approx(4 / 255) and zp.item() == 64
    x = torch.tensor([-1.0, 0.0, 3.0, 5.0, -2.0])
    out = fq_asym(x, scale, zp, 8)
    # codes RNE(x/s)+64: -1 -> -63.75 -> -64+64=0; 0 -> 64; 3 -> 191+64=255; 5 -> clamp 255; -2 -> clamp 0
    assert out.tolist() == pytest.approx([-64 * 4 / 255, 0.0, 191 * 4 / 255, 191 * 4 / 255, -64 * 4 / 255], rel=1e-6)
    assert torch.equal(out, fq_asym_ref(x, float(scale), float(zp), 8))
    # a constant range: the scale floor 1e-5 keeps it finite
    s0, z0 = asym_params(torch.tensor(2.0), torch.tensor(2.0), 8)
    assert s0.item() == pytest.approx(1e-5) and torch.isfinite(fq_asym(torch.tensor([2.0]), s0, z0, 8)).all()


def test_asym_rows_take_each_sequence_min_and_max():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 7, 4, generator=g)
    x[1] *= 100  # a sequence with a 100x range must not change the others' scales
    out = fq_asym_rows(x, 8)
    assert torch.equal(out, fq_asym_rows_ref(x, 8))
    assert torch.equal(out[0], fq_asym_rows(x[:1], 8)[0]) and torch.equal(out[2], fq_asym_rows(x[2:], 8)[0])
    for k in range(3):  # each row's error is at most half its own step
        step = (x[k].max() - x[k].min()) / 255
        assert (out[k] - x[k]).abs().max() <= step / 2 + 1e-6


def test_percentile_clip_is_near_min_max_and_clips_an_outlier():
    w = torch.arange(1000.0).reshape(1, 1000)
    w[0, -1] = 1e6
    lo, hi = percentile_clip_rows(w, 0.99)
    assert lo.item() == pytest.approx(9.99, abs=1e-3) and 989 < hi.item() < 1000
    lo, hi = percentile_clip_rows(torch.tensor([[0.0, 1.0, 2.0]]), 1.0)
    assert (lo.item(), hi.item()) == (0.0, 2.0)


def test_sym_mse_scales_search_the_shrink_and_match_the_ref():
    from harness.kernels.fakequant import sym_mse_scales, sym_mse_scales_ref
    g = torch.Generator().manual_seed(3)
    w = torch.randn(5, 40, generator=g)
    w[0, 0] = 30.0  # an outlier row: the MSE search shrinks its range below the plain max / 7
    s = sym_mse_scales(w, 4)
    assert torch.allclose(s, sym_mse_scales_ref(w, 4), rtol=1e-6)
    plain = torch.maximum(w.min(1)[0].clip(max=0) / -8, w.max(1)[0].clip(min=1e-6) / 7)
    assert (s[:, 0] <= plain + 1e-7).all() and s[0, 0] < plain[0]
    assert s[0, 0] >= 0.21 * plain[0] - 1e-7  # maxshrink 0.8: p never below 0.21
