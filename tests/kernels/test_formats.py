"""harness.formats against ../shared/reference/formats.md: torchao 0.18.0 for MX and NVFP4 (bit for bit), the
256 HiFloat8 codes decoded from the bit layout, the integer formats as written, and the edge cases of every
format (ties, max-normal and subnormal edges, zeros, all-zero blocks, outliers, NaN/Inf, ranks, strides)."""
import warnings

import numpy as np
import pytest
import torch

from harness.formats import FORMATS, fake_quantize

ALL = list(FORMATS)
NAMES = ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e2m3", "mxfp6_e3m2",
         "mxfp4_e2m1", "nvfp4", "nvfp4_noglobal", "hifp8", "int8", "int8_g128", "int4_g128"]
MX_ELEM = {"mxfp8_e4m3": torch.float8_e4m3fn, "mxfp8_e5m2": torch.float8_e5m2, "mxfp6_e2m3": "fp6_e2m3",
           "mxfp6_e3m2": "fp6_e3m2", "mxfp4_e2m1": torch.float4_e2m1fn_x2}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact in formats.md's sense: NaN at the same places, every other element equal (+0 == -0)."""
    na, nb = a.isnan(), b.isnan()
    return a.shape == b.shape and torch.equal(na, nb) and torch.equal(a[~na], b[~nb])


def data(shape, seed=0, spread=3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * torch.exp(spread * torch.randn(shape, generator=g))).float()


def test_the_fifteen_formats_exist_with_their_blocks():
    assert set(NAMES) <= set(FORMATS)
    assert {n: FORMATS[n].block for n in NAMES if FORMATS[n].block} == {
        **{n: 32 for n in MX_ELEM}, "nvfp4": 16, "nvfp4_noglobal": 16, "int8_g128": 128, "int4_g128": 128}
    assert FORMATS["mxfp4_e2m1"].bits == 4.25 and FORMATS["nvfp4"].bits == 4.5 and FORMATS["bf16"].bits == 16


# ---- torchao 0.18.0 (the reference of MX and NVFP4) ----

@pytest.fixture(scope="module")
def torchao_ref():
    pytest.importorskip("torchao", reason="pip install 'quamba-harness[formats]' (torchao==0.18.0)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torchao
        from torchao.prototype.mx_formats.mx_tensor import MXTensor
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
    assert torchao.__version__ == "0.18.0"

    def ref(x: torch.Tensor, fmt: str) -> torch.Tensor:
        if fmt in MX_ELEM:
            return MXTensor.to_mx(x, MX_ELEM[fmt], block_size=32).dequantize(torch.float32)
        p = per_tensor_amax_to_scale(x.abs().amax()) if fmt == "nvfp4" else None
        return NVFP4Tensor.to_nvfp4(x, block_size=16, per_tensor_scale=p).dequantize(torch.float32)
    return ref


def _hard_blocks(scale: float, seed: int) -> torch.Tensor:
    """64 x 256 values over ~25 binades around `scale`, with blocks that are all zero, subnormal, one outlier,
    the E8M0 byte-0 range (amax < 2^-118) and values on element ties."""
    x = data((64, 256), seed) * scale
    x = x.clamp(-3.0e38, 3.0e38)
    x[0, :32] = 0.0
    x[1, :32] = -0.0
    x[3, :] = 0.0
    x[3, 3] = min(1e4 * scale, 3.0e38)            # one outlier sets the scale of its block
    x[4, :32] = data((32,), seed + 1, 0.5) * 1e-42  # float32 subnormals
    x[5, :32] = data((32,), seed + 2, 0.5) * 2.0 ** -120  # E8M0 byte 0 for e4m3 (torchao's x0.5 quirk)
    x[6, :16] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 2)  # e2m1 ties at scale 1
    x[7, :32] = torch.tensor([448.0, 1.0625, 1.1875, 464.0] * 8)                # e4m3 ties and max
    return x


@pytest.mark.parametrize("fmt", [*MX_ELEM, "nvfp4", "nvfp4_noglobal"])
@pytest.mark.parametrize("scale", [1e-40, 1e-20, 1e-3, 1.0, 1e3, 1e25, 3e34])
def test_mx_and_nvfp4_equal_torchao(torchao_ref, fmt, scale):
    for seed in range(2):
        x = _hard_blocks(scale, seed)
        got, want = fake_quantize(x, fmt), torchao_ref(x, fmt)
        assert same(got, want), (fmt, scale, (got != want).sum())


@pytest.mark.parametrize("fmt", [*MX_ELEM, "nvfp4_noglobal"])
def test_mx_and_nvfp4_noglobal_nan_and_inf_blocks_equal_torchao(torchao_ref, fmt):
    x = _hard_blocks(1.0, 3)
    x[10, 5], x[11, 40], x[12, 70] = float("inf"), float("-inf"), float("nan")
    assert same(fake_quantize(x, fmt), torchao_ref(x, fmt))


def test_mx_on_rank3_equals_torchao(torchao_ref):
    x = data((3, 8, 64), 5)
    for fmt in MX_ELEM:
        assert same(fake_quantize(x, fmt), torchao_ref(x, fmt))
    assert same(fake_quantize(x, "nvfp4"), torchao_ref(x, "nvfp4"))


# ---- HiFloat8: the 256 codes, decoded here from the bit layout of formats.md ----

def hif8_decode(code: int) -> float:
    """S | dot | E (D bits, MSB = sign) | M; dot 11: D=4 M=1, 10: D=3 M=2, 01: D=2 M=3, 001: D=1 M=3,
    0001: D=0 M=3, 0000: denormal 2^(M-23). 0x00 = 0, 0x80 = NaN, 0x6F / 0xEF = +-inf."""
    sign = -1.0 if code & 0x80 else 1.0
    r = code & 0x7F
    if code == 0x80:
        return float("nan")
    if r >> 5 == 0b11:
        d, rest_bits = 4, 5
    elif r >> 5 == 0b10:
        d, rest_bits = 3, 5
    elif r >> 5 == 0b01:
        d, rest_bits = 2, 5
    elif r >> 4 == 0b001:
        d, rest_bits = 1, 4
    elif r >> 3 == 0b0001:
        d, rest_bits = 0, 3
    else:
        m = r & 0b111
        return 0.0 if m == 0 else sign * 2.0 ** (m - 23)
    m_bits = rest_bits - d
    rest = r & ((1 << rest_bits) - 1)
    e_field, m = rest >> m_bits, rest & ((1 << m_bits) - 1)
    if d == 0:
        exp = 0
    else:
        mag = (1 << (d - 1)) + (e_field & ((1 << (d - 1)) - 1))
        exp = -mag if e_field >> (d - 1) else mag
    if d == 4 and exp == 15 and m == 1:
        return sign * float("inf")
    return sign * 2.0 ** exp * (1 + m / 2 ** m_bits)


HIF8 = [hif8_decode(c) for c in range(256)]
HIF8_FINITE = sorted({v for v in HIF8 if np.isfinite(v)})


def test_hifp8_code_table_has_the_documented_shape():
    assert sum(np.isnan(v) for v in HIF8) == 1 and HIF8.count(float("inf")) == 1 and HIF8.count(-float("inf")) == 1
    assert len(HIF8_FINITE) == 253 and HIF8.count(0.0) == 1          # 252 nonzero finite values, one zero
    assert max(HIF8_FINITE) == 32768.0 and HIF8[0x6E] == 32768.0 and HIF8[0x7E] == 2.0 ** -15
    assert min(v for v in HIF8_FINITE if v > 0) == 2.0 ** -22
    binades = {int(np.floor(np.log2(abs(v)))) for v in HIF8_FINITE if v}
    assert binades == set(range(-22, 16))                                # 38 binades


def test_hifp8_maps_every_code_to_itself():
    codes = torch.tensor([v for v in HIF8 if not np.isnan(v)], dtype=torch.float32)
    assert same(fake_quantize(codes, "hifp8"), codes)
    assert torch.isnan(fake_quantize(torch.tensor([float("nan")]), "hifp8")).all()


def _nearest_away(x: np.ndarray) -> np.ndarray:
    """Nearest finite HiF8 value, ties away from zero, by search of the table in float64; >= 40960 -> inf."""
    grid = np.array([v for v in HIF8_FINITE if v >= 0] + [49152.0])  # 0x6F's would-be value 1.5 * 2^15
    a = np.abs(x.astype(np.float64))
    hi = np.searchsorted(grid, a, side="left").clip(1, len(grid) - 1)
    lo_v, hi_v = grid[hi - 1], grid[hi]
    pick = np.where(a - lo_v < hi_v - a, lo_v, hi_v)
    pick = np.where(a == lo_v, lo_v, pick)
    pick = np.where(pick > 32768.0, np.inf, pick)
    pick = np.where(a >= 49152.0, np.inf, pick)
    return np.where(pick == 0, 0.0, np.copysign(pick, x)).astype(np.float32)


def test_hifp8_is_the_nearest_code_with_ties_away():
    grid = np.array(HIF8_FINITE, dtype=np.float64)
    mids = (grid[1:] + grid[:-1]) / 2                         # every tie (all exact in float32)
    rng = np.random.default_rng(0)
    rand = (rng.standard_normal(20000) * np.exp2(rng.uniform(-26, 17, 20000))).astype(np.float32)
    x = np.concatenate([mids, np.nextafter(mids, 0), np.nextafter(mids, np.inf), rand]).astype(np.float32)
    assert np.array_equal(mids.astype(np.float32).astype(np.float64), mids)
    got = fake_quantize(torch.from_numpy(x), "hifp8").numpy()
    assert np.array_equal(got, _nearest_away(x))
    assert np.array_equal(np.signbit(got), np.signbit(x) & (got != 0))  # zeros are +0


def test_hifp8_edges():
    x = torch.tensor([40960.0, 40959.996, -40960.0, 1e30, float("inf"), float("-inf"), 2.0 ** -23,
                      float(np.nextafter(np.float32(2.0 ** -23), np.float32(0))), 1.5 * 2.0 ** -22, -0.0, 1e-45, 1.0625,
                      1.5 * 2.0 ** -16])
    want = torch.tensor([float("inf"), 32768.0, -float("inf"), float("inf"), float("inf"), float("-inf"),
                         2.0 ** -22, 0.0, 2.0 ** -21, 0.0, 0.0, 1.125, 2.0 ** -15])
    got = fake_quantize(x, "hifp8")
    assert same(got, want) and not torch.signbit(got[9])


# ---- the integer formats, as written (numpy float32 arithmetic = one IEEE fl32 operation each) ----

def int_reference(x: np.ndarray, fmt: str) -> np.ndarray:
    block = {"int8": x.size, "int8_g128": 128, "int4_g128": 128}[fmt]
    g = x.reshape(-1, block).astype(np.float32)
    a = np.abs(g).max(axis=1, keepdims=True)
    out = np.zeros_like(g)
    for i in range(g.shape[0]):
        if fmt == "int4_g128":
            s = a[i] * np.float32(2.0 / 15.0)
            y = (np.clip(np.rint(g[i] / s) + np.float32(8), 0, 15) - np.float32(8)) * s if s[0] != 0 else 0
        else:
            s = a[i] / np.float32(127)
            y = np.clip(np.rint(g[i] / s), -127, 127) * s if s[0] != 0 else 0
        out[i] = y
    return out.reshape(x.shape)


@pytest.mark.parametrize("fmt", ["int8", "int8_g128", "int4_g128"])
@pytest.mark.parametrize("scale", [1e-38, 1.0, 1e30])
def test_integer_formats_as_written(fmt, scale):
    x = data((4, 384), 7) * scale
    x[1, :128] = 0.0
    x[2, 128:256] = torch.arange(128) - 63.5  # ties x / s = k + 0.5 in int8 where s = 1 (amax 127 would)
    with np.errstate(all="ignore"):
        want = int_reference(x.numpy(), fmt)
    assert same(fake_quantize(x, fmt), torch.from_numpy(want))


def test_int4_g128_scale_constant_and_asymmetry():
    """s = a * fl32(2/15) (0x3E088889), not a / 7.5: where x / s is exactly +-7.5, -a -> -8s and +a -> +7s."""
    assert np.float32(2.0 / 15.0).view(np.uint32) == 0x3E088889
    for a in np.linspace(1.0, 2.0, 2000, dtype=np.float32):
        s = a * np.float32(2.0 / 15.0)
        if a / s == np.float32(7.5):
            break
    else:
        pytest.fail("no amax with a / s == 7.5 in [1, 2]")
    x = torch.zeros(128)
    x[0], x[1] = float(a), -float(a)
    y = fake_quantize(x, "int4_g128")
    assert y[0] == np.float32(7) * s and y[1] == np.float32(-8) * s


def test_integer_ties_round_half_even():
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -2.5, -0.5, 126.5])
    assert same(fake_quantize(x, "int8"), torch.tensor([127.0, 0.0, 2.0, 2.0, -2.0, 0.0, 126.0]))


# ---- per-tensor fp8 and the casts ----

def test_fp8_per_tensor_ties_max_and_subnormals():
    # amax 448 -> s = 1: the grid is e4m3's own (ties to even mantissa, subnormals 2^-9 apart)
    x = torch.tensor([448.0, 1.0625, 1.1875, -1.0625, 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -11, 0.0, -0.0])
    want = torch.tensor([448.0, 1.0, 1.25, -1.0, 0.0, 2.0 ** -8, 0.0, 0.0, 0.0])
    assert same(fake_quantize(x, "fp8_e4m3"), want)
    x = torch.tensor([57344.0, 1.125, 1.375, 2.0 ** -17, 3 * 2.0 ** -17])  # e5m2: s = 1, subnormals 2^-16
    assert same(fake_quantize(x, "fp8_e5m2"), torch.tensor([57344.0, 1.0, 1.5, 0.0, 2.0 ** -15]))


def test_fp8_scale_is_amax_over_fmax_in_float32():
    x = data((8, 24), 11)
    for fmt, fmax in (("fp8_e4m3", 448.0), ("fp8_e5m2", 57344.0)):
        s = x.abs().amax() / fmax
        elem = torch.float8_e4m3fn if fmt == "fp8_e4m3" else torch.float8_e5m2
        want = (x / s).clamp(-fmax, fmax).to(elem).float() * s
        assert same(fake_quantize(x, fmt), want)


def test_bf16_fp16_overflow_edges():
    big = (2 - 2.0 ** -8) * 2.0 ** 127
    x = torch.tensor([big, float(np.nextafter(np.float32(big), np.float32(0))), 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8])
    assert same(fake_quantize(x, "bf16"), torch.tensor([float("inf"), 2.0 ** 127 * (2 - 2.0 ** -7), 1.0,
                                                        1.0 + 2.0 ** -6]))
    x = torch.tensor([65520.0, 65519.996, 2.0 ** -25, 3 * 2.0 ** -25, 2.0 ** -26])
    assert same(fake_quantize(x, "fp16"), torch.tensor([float("inf"), 65504.0, 0.0, 2.0 ** -23, 0.0]))


# ---- the block formats at scale 1 (ties and max of the element grids) ----

def test_mxfp4_and_nvfp4_noglobal_ties_at_scale_one():
    x = torch.zeros(32)
    x[:8] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    want = torch.zeros(32)
    want[:8] = torch.tensor([6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])
    assert same(fake_quantize(x, "mxfp4_e2m1"), want)   # amax 6: E8M0 scale 2^(2-2) = 1
    assert same(fake_quantize(x, "nvfp4_noglobal"), want)  # amax / 6 = 1, an e4m3 value


@pytest.mark.parametrize("fmt,vmax", [("mxfp6_e2m3", 7.5), ("mxfp6_e3m2", 28.0), ("mxfp8_e5m2", 57344.0),
                                      ("mxfp8_e4m3", 448.0)])
def test_mx_element_max_and_smallest_subnormal(fmt, vmax):
    mbits, emin = {"mxfp6_e2m3": (3, 0), "mxfp6_e3m2": (2, -2), "mxfp8_e5m2": (2, -14), "mxfp8_e4m3": (3, -6)}[fmt]
    tiny = 2.0 ** (emin - mbits)
    x = torch.zeros(32)
    x[:4] = torch.tensor([vmax, tiny, tiny / 2, 3 * tiny / 2])  # tiny / 2 ties to 0, 3/2 tiny to 2 tiny
    want = torch.zeros(32)
    want[:4] = torch.tensor([vmax, tiny, 0.0, 2 * tiny])
    assert same(fake_quantize(x, fmt), want)


# ---- every format: shapes, strides, zeros, NaN/Inf policy, input untouched ----

PER_TENSOR = ("fp8_e4m3", "fp8_e5m2", "int8", "nvfp4")


@pytest.mark.parametrize("fmt", NAMES)
def test_rank_1_to_4_and_strides_give_the_same_values(fmt):
    x = data((2, 3, 4, 256), 13)
    whole = fake_quantize(x, fmt)
    assert whole.dtype == torch.float32 and whole.shape == x.shape
    assert same(fake_quantize(x.reshape(6, 4, 256), fmt), whole.reshape(6, 4, 256))
    assert same(fake_quantize(x.reshape(24, 256), fmt), whole.reshape(24, 256))
    row = x[1, 2, 3]
    assert same(fake_quantize(row, fmt), fake_quantize(row.reshape(1, 256), fmt).reshape(256))
    if fmt not in PER_TENSOR:                         # groups along the last dim: a row alone is the same
        assert same(fake_quantize(row, fmt), whole[1, 2, 3])
    t = x.permute(0, 2, 1, 3)                         # non-contiguous rank 4 with the same last dim
    assert not t.is_contiguous()
    assert same(fake_quantize(t, fmt), fake_quantize(t.contiguous(), fmt))


@pytest.mark.parametrize("fmt", NAMES)
def test_x_is_never_modified_and_the_result_is_new(fmt):
    x = data((4, 256), 17).t()[:, :].t()
    x[0, 0], x[1, 1] = float("nan"), float("inf")
    before = x.clone()
    y = fake_quantize(x, fmt)
    assert same(x, before) and torch.equal(x.isinf(), before.isinf())
    y.add_(1.0)
    assert same(x, before)


@pytest.mark.parametrize("fmt", NAMES)
def test_zeros_and_negative_zero_and_all_zero_blocks(fmt):
    assert torch.equal(fake_quantize(torch.zeros(2, 256), fmt), torch.zeros(2, 256))
    assert torch.equal(fake_quantize(-torch.zeros(2, 256), fmt), torch.zeros(2, 256))  # +0 == -0
    x = data((2, 256), 19)
    x[:, :128] = 0.0
    y = fake_quantize(x, fmt)
    assert torch.isfinite(y).all() and torch.equal(y[:, :128], torch.zeros(2, 128))


@pytest.mark.parametrize("fmt", [n for n in NAMES if FORMATS[n].block])
def test_one_outlier_sets_only_its_blocks_scale(fmt):
    block = FORMATS[fmt].block
    x = data((1, 4 * block), 23, spread=0.3)
    y0 = fake_quantize(x, fmt)
    x[0, 1] = 2.0 ** 40                                             # beyond every element's dynamic range
    y = fake_quantize(x, fmt)
    assert y[0, 1] == 2688.0 if fmt == "nvfp4_noglobal" else y[0, 1] > 2.0 ** 39  # e4m3 scale saturates at 448
    assert torch.equal(y[0, 2:block], torch.zeros(block - 2))       # its neighbours flush to zero
    if fmt != "nvfp4":                                              # nvfp4's global scale sees the outlier
        assert torch.equal(y[0, block:], y0[0, block:])


def _expected_nan_mask(fmt: str, shape, pos) -> torch.Tensor:
    mask = torch.zeros(shape, dtype=torch.bool)
    block = FORMATS[fmt].block
    if fmt in ("bf16", "fp16", "hifp8"):
        mask[pos] = True
    elif fmt in PER_TENSOR:
        mask[:] = True
    else:
        start = pos[1] // block * block
        mask[pos[0], start:start + block] = True
    return mask


@pytest.mark.parametrize("fmt", NAMES)
def test_nan_policy(fmt):
    x = data((3, 256), 29)
    x[1, 130] = float("nan")
    assert torch.equal(fake_quantize(x, fmt).isnan(), _expected_nan_mask(fmt, x.shape, (1, 130)))


@pytest.mark.parametrize("fmt", NAMES)
def test_inf_policy(fmt):
    x = data((3, 256), 31)
    x[1, 130] = -float("inf")
    y = fake_quantize(x, fmt)
    if fmt in ("bf16", "fp16", "hifp8"):
        assert y[1, 130] == -float("inf") and torch.isfinite(y.flatten()[torch.arange(y.numel()) != 386]).all()
    elif fmt.startswith("mx") or fmt == "nvfp4_noglobal":
        block = FORMATS[fmt].block
        start = 130 // block * block
        assert y[1, 130] == (-2688.0 if fmt == "nvfp4_noglobal" else -float("inf"))
        others = torch.cat([y[1, start:130], y[1, 131:start + block]])
        assert others.abs().max() < 1e-30 if fmt.startswith("mx") else others.abs().max() <= 448 * 6
        y[1, start:start + block] = 0
        assert torch.isfinite(y).all()
    else:
        assert torch.equal(y.isnan(), _expected_nan_mask(fmt, x.shape, (1, 130)))


@pytest.mark.parametrize("fmt", [n for n in NAMES if FORMATS[n].block])
def test_a_last_dim_off_the_block_is_a_value_error_naming_format_and_size(fmt):
    with pytest.raises(ValueError, match=rf"format {fmt}: the last dimension \(40\) is not a multiple of its "
                                         rf"block size {FORMATS[fmt].block}"):
        fake_quantize(torch.ones(3, 40), fmt)


def test_unknown_format_and_scalar_are_value_errors():
    with pytest.raises(ValueError, match="unknown format 'fp7'; valid: bf16, fp16"):
        fake_quantize(torch.ones(4), "fp7")
    with pytest.raises(ValueError, match="rank >= 1"):
        fake_quantize(torch.tensor(1.0), "bf16")
