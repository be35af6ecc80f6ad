"""kernels.vquant (the Quamba-SE fork's virtual-INT8 quantizers) against the written-out twins of kernels.vquant_ref
on crafted tensors at every boundary: ties at the segment edges, |q| = 31/32, 63/64, 127/128, 143/144, the log2
bucket edges, and the reciprocal-multiply cases; and the facts docs/se-modes.md states about the fork."""
import numpy as np
import pytest
import torch

from harness.kernels import vquant as V
from harness.kernels import vquant_ref as R

S = float(np.float32(0.0123456789))  # an fp32 value, as conv1d.output_scale.item() is


def _near(values: list[float], s: float = S) -> torch.Tensor:
    """Each v * s, and the fp32 neighbours on either side."""
    out = []
    for v in values:
        x = np.float32(v * s)
        out += [np.nextafter(x, np.float32(-np.inf)), x, np.nextafter(x, np.float32(np.inf))]
    t = torch.tensor(np.array(out, dtype=np.float32))
    return torch.cat([t, -t])


EDGES = [0.0, 0.125, 0.375, 0.5, 1.5, 2.5, 7.875, 8.0, 8.125, 8.25, 8.5, 9.0, 10.0, 12.0, 15.625, 15.75, 15.875,
         16.0, 24.0, 31.0, 31.5, 32.0, 32.5, 40.0, 63.0, 63.5, 64.0, 64.5, 72.0, 127.0, 127.5, 128.0, 128.5, 136.0,
         143.0, 143.5, 144.0, 144.5, 145.0, 147.0, 264.0, 395.0, 396.0, 2000.0]
X = _near(EDGES)


@pytest.mark.parametrize("div", V.DIVISIONS)
@pytest.mark.parametrize("rounding", V.ROUNDINGS)
def test_grids_match_the_written_out_reference(rounding, div):
    assert torch.equal(V.vq_grid(X, S, rounding, div).u, R.vq_grid_ref(X, S, rounding, div))
    assert torch.equal(V.vq_outlier(X, S, rounding, div).u, R.vq_outlier_ref(X, S, rounding, div))
    assert torch.equal(V.vq_dual(X, S, 3.1 * S, rounding, div).u, R.vq_dual_ref(X, S, 3.1 * S, rounding, div))
    for factor, limit in ((4, 32), (2, 64)):
        assert torch.equal(V.vq_fine(X, S, factor, limit, rounding, div).u,
                           R.vq_fine_ref(X, S, factor, limit, rounding, div))
    assert torch.equal(V.xproj_codes(X, S, rounding, div).codes, R.xproj_codes_ref(X, S, rounding, div))


@pytest.mark.parametrize("div", V.DIVISIONS)
def test_log2_and_three_segment_match_the_reference(div):
    assert torch.equal(V.vq_quarter_log2(X, S, div).u, R.vq_quarter_log2_ref(X, S, div))
    assert torch.equal(V.vq_three_segment(X, S, div).u, R.vq_three_segment_ref(X, S, div))


def test_dynamic_scale_is_a_true_division_and_matches():
    os = V.dynamic_outlier_scale(X, S, "rna")
    top = np.float32(X.abs().max().item())
    assert float(os) == float(top * (np.float32(1) / np.float32(127)))  # max / 127.0: a reciprocal multiply
    assert torch.equal(V.vq_dual(X, S, os, "rna").u, R.vq_dual_ref(X, S, float(os), "rna", os_exact=True))


def test_round_fork_is_not_c_roundf():
    """roundf_like adds 0.5 in fp32: 0.49999997 + 0.5 rounds to 1.0 (C roundf: 0); ties go away from zero."""
    v = torch.tensor([0.49999997, -0.49999997, 2.5, -2.5, 1.5], dtype=torch.float32)
    assert V.round_fork(v).tolist() == [1.0, -1.0, 3.0, -3.0, 2.0]
    assert V.round_code(v, "rne").tolist() == [0.0, -0.0, 2.0, -2.0, 2.0]
    assert [float(R.round_fork_ref(np.float32(e))) for e in v.tolist()] == [1.0, -1.0, 3.0, -3.0, 2.0]


def test_reciprocal_multiply_changes_codes_at_ties():
    """x * fl32(1/s) and x / s round differently for some x near a tie: search them, then both kernels follow
    their own reference there."""
    s = float(np.float32(0.1))
    x = torch.tensor([np.float32((k + 0.5) * s) for k in range(-300, 300)], dtype=torch.float32)
    x = torch.cat([x, torch.nextafter(x, torch.tensor(np.inf)), torch.nextafter(x, torch.tensor(-np.inf))])
    recip, exact = V.div_scalar(x, s, "recip"), V.div_scalar(x, s, "exact")
    differ = recip != exact
    assert int(differ.sum()) > 0
    for rounding in V.ROUNDINGS:
        a, b = V.round_code(recip, rounding), V.round_code(exact, rounding)
        assert (a != b).any(), rounding
        assert torch.equal(V.xproj_codes(x, s, rounding, "recip").codes, R.xproj_codes_ref(x, s, rounding, "recip"))
        assert torch.equal(V.xproj_codes(x, s, rounding, "exact").codes, R.xproj_codes_ref(x, s, rounding, "exact"))


def test_outlier_segment_counts_minus_128_and_keeps_the_value():
    """5-2: |q| > 127 keeps x; q = -128 (x = -127.7 s) is an outlier too; 127.4 s stays on the grid."""
    x = torch.tensor([127.4 * S, -127.7 * S, 200 * S], dtype=torch.float32)
    v = V.vq_outlier(x, S, "rna")
    assert v.seg.tolist() == [0, 1, 1]
    assert v.u[1:].tolist() == x[1:].tolist()
    assert v.u[0].item() == pytest.approx(127 * S, rel=1e-6)


def test_quarter_double_rounding_of_xproj():
    """5-4: x = 0.4 s -> u = 0.5 s -> x_proj code 1 (5-0 gives 0); x in [k + 0.375, k + 0.5) s rounds up."""
    x = torch.tensor([0.4 * S, 3.4 * S, -0.4 * S], dtype=torch.float32)
    u = V.vq_fine(x, S, 4, 32, "rna").u
    assert V.xproj_codes(u, S, "rna").codes.tolist() == [1, 4, -1]
    assert V.xproj_codes(x, S, "rna").codes.tolist() == [0, 3, 0]


def test_quarter_log2_grid():
    """5-6: |x| <= 8s on s/4 steps; above, 8s + 2^k s/4 floor-based: 20s -> 16s, 100s -> 72s, 8.1s -> 8.25s."""
    x = torch.tensor([20 * S, 100 * S, 8.1 * S, -8.1 * S, 8 * S, 300 * S], dtype=torch.float32)
    v = V.vq_quarter_log2(x, S)
    assert (v.u / S).tolist() == pytest.approx([16, 72, 8.25, -8.25, 8, 264], rel=1e-6)
    assert v.seg.tolist() == [1, 1, 1, 1, 0, 1]
    assert V.xproj_codes(v.u, S, "rna").codes.tolist()[:2] == [16, 72]


def test_log2_bucket_edge_rounds_the_logarithm_to_fp32():
    """Just below 8s + 2^k s/4 the fp32 log2 of the quotient rounds up to k: the bucket is k, as on the GPU."""
    x = torch.tensor([np.nextafter(np.float32(8 * S + 4 * S), np.float32(0))], dtype=torch.float32)
    assert torch.equal(V.vq_quarter_log2(x, S).u, R.vq_quarter_log2_ref(x, S))


def test_three_segment_levels_and_saturation():
    """5-7: saturates at 395 s (not 396), and has 509 distinct values (9 bits, not 8)."""
    s = 1.0
    x = torch.linspace(-500, 500, 400001, dtype=torch.float32)
    v = V.vq_three_segment(x, s)
    assert v.u.abs().max().item() == 395.0
    assert v.u.unique().numel() == 509
    assert set(v.seg.unique().tolist()) == {0, 1, 2}
    assert V.xproj_codes(torch.tensor([140.0, 300.0]), s, "rna").codes.tolist() == [127, 127]


def test_dual_scale_modest_outlier_can_escape_saturation():
    """5-3: outliers 130 s and 2000 s give os ~ 15.75 s, and 130 s -> 8 os ~ 126 s -> x_proj code 126."""
    x = torch.tensor([130 * S, 2000 * S, S], dtype=torch.float32)
    os = V.dynamic_outlier_scale(x, S, "rna")
    assert float(os) / S == pytest.approx(2000 / 127, rel=1e-6)
    u = V.vq_dual(x, S, os, "rna").u
    assert V.xproj_codes(u, S, "rna").codes.tolist() == [126, 127, 1]
    no_outlier = torch.tensor([S, -S])
    assert float(V.dynamic_outlier_scale(no_outlier, S, "rna")) == pytest.approx(S)


@pytest.mark.parametrize("seqlen, tile", [(128, (32, 4)), (256, (32, 8)), (64, None), (512, None), (200, None)])
def test_striped_read_order(seqlen, tile):
    u = torch.arange(2 * seqlen * 3, dtype=torch.float32).reshape(2, seqlen, 3)
    assert V.kernel_tile(seqlen) == tile
    got = V.striped_u(u)
    assert torch.equal(got, u if tile is None else R.striped_u_ref(u, *tile))
    if tile is not None:
        assert not torch.equal(got, u) and torch.equal(got.sort(dim=1).values, u)


def test_segment_shares_sum_to_one():
    x = torch.tensor([0.1 * S, 20 * S, 100 * S, -300 * S])
    shares = V.segment_shares(x, V.vq_three_segment(x, S))
    assert sum(v["fraction"] for v in shares.values()) == pytest.approx(1.0)
    assert sum(v["error_share"] for v in shares.values()) == pytest.approx(1.0)
    assert shares["low"]["fraction"] == 0.25 and shares["high"]["fraction"] == 0.25


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="valid: recip, exact"):
        V.div_scalar(X, S, "fast")
    with pytest.raises(ValueError, match="valid: rna, rne"):
        V.round_code(X, "up")


def test_mode4_conv_is_the_dequantized_float_conv_with_y_sigmoid_y():
    """Mode 4's conv (qConvLayer.py:110-128) against the float64 oracle: same values to fp32 accuracy; and its
    SiLU is y * sigmoid(y), not the kernel's y / (1 + exp(-y)), so some element differs from the int8 kernel's
    fp32 output in the last bit."""
    from harness.kernels.conv1d import causal_conv1d_silu_ref, dequantized_conv1d_silu, int8_causal_conv1d_silu
    from harness.spec import FloatOut, QTensor
    g = torch.Generator().manual_seed(0)
    x = QTensor(torch.randint(-128, 128, (2, 9, 16), generator=g, dtype=torch.int8), 0.02)
    w = QTensor(torch.randint(-128, 128, (16, 4), generator=g, dtype=torch.int8), 0.003)
    b = QTensor(torch.randint(-128, 128, (16,), generator=g, dtype=torch.int8), 0.01)
    got = dequantized_conv1d_silu(x, w, b)
    assert got.dtype == torch.float32
    ref = causal_conv1d_silu_ref(x.dequantize(), w.dequantize(), b.dequantize())
    assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-6)
    kern = int8_causal_conv1d_silu(x, w, b, FloatOut(torch.float32))
    assert torch.allclose(got, kern, rtol=1e-5, atol=1e-6) and not torch.equal(got, kern)


def test_the_forks_expressions_on_the_cpu_are_the_exact_division_emulation():
    """tools/se_gpu_check.py writes each quantizer as the fork's code does (qMambaLayer.py at f4d350a). On the CPU,
    where PyTorch divides exactly, they give the "exact" emulation bit for bit; the "recip" one (CUDA's, checked on
    an H200 by that tool) differs at ties."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    from se_gpu_check import MODES, _emulated, _fork, crafted
    x, s, os = crafted(5000)
    for mode in MODES:
        u_fork, c_fork = _fork(mode, x, s, os, torch)
        u, c = _emulated(mode, x, s, os, "exact")
        assert torch.equal(u, u_fork) and torch.equal(c, c_fork), mode
    u, c = _emulated("5-4", x, s, os, "recip")
    assert not torch.equal(c, _fork("5-4", x, s, os, torch)[1])
