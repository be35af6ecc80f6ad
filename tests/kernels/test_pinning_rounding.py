"""Every call site's tie rule and epilogue order, pinned at the block level on inputs where the choices differ.

Blocks are built by ``harness.emulation.build.build_block`` for a built-in recipe; each site is
fed an input (and given a calibrated scale) constructed so that its value lands
exactly on a .5 tie (half-even and half-away disagree there), or so that the two
fp32 epilogue orders give values on different sides of a rounding boundary.

The tables RULES and EPILOGUES are the specification; mode 3's float in_proj
follows ``W8A8B16O16Linear.forward`` (weight scale first, issue 11).
"""
import copy
import dataclasses

import numpy as np
import pytest
import torch

from harness.architectures.mamba1.build import build_block
from harness.checkpoints.loading import open_checkpoint
from harness.modes import BUILTIN_MODES
from harness.kernels.hadamard import hadamard_transform
from harness.kernels.linear import Epilogue
from harness.spec import FloatOut, LayerScales, QTensor, QuantOut, Rounding
from harness.runner.weightbank import WeightBank

EVEN, AWAY = Rounding.HALF_EVEN, Rounding.HALF_AWAY
RW, WR = Epilogue.RATIO_THEN_WEIGHT, Epilogue.WEIGHT_THEN_RATIO

# site -> (scale name of its int8 output, tie rule); spec notes §2.6 steps 1-9
RULES = {"norm": ("s_in", EVEN), "in_proj": ("s_xz", EVEN), "conv1d": ("s_u", AWAY), "x_proj": ("s_xp", EVEN),
         "dt_proj": ("s_dt", EVEN), "had": ("s_H", AWAY)}
# (mode, site) -> epilogue order of the W8A8 GEMM (spec notes §2.6 steps 2, 4, 5, 9)
EPILOGUES = {("0", "in_proj"): RW, ("0", "x_proj"): WR, ("0", "dt_proj"): RW, ("0", "out_proj"): WR,
             ("3", "in_proj"): WR,  # float (fp16) output: W8A8B16O16Linear.forward order (issue 11)
             ("3", "out_proj"): WR}
SCALES = LayerScales(s_in=0.0211, s_xz=0.0312, s_u=0.0133, s_xp=0.0457, s_dt=0.0119, s_h=0.0071, s_H=0.0263)
f32 = np.float32


@pytest.fixture(scope="module")
def bank(hf_dir):
    return WeightBank(open_checkpoint(hf_dir))


def _block(bank, mode, scales=SCALES, **knobs):
    recipe = dataclasses.replace(BUILTIN_MODES[mode], **knobs) if knobs else BUILTIN_MODES[mode]
    params = bank.layer(0, recipe.weights, recipe.rotate == "yes")
    return build_block(recipe, params, scales, bank.ckpt.dims, 0)


def _rne(v):
    return np.round(np.float64(v))


def _rna(v):
    v = np.float64(v)
    return np.sign(v) * np.floor(np.abs(v) + 0.5)


def _tie_scale(v: float, k: int) -> float:
    """A fp32 scale s with f32(v / s) == +-(k' + 0.5) exactly, for an even k' near k (the two rules differ)."""
    for kk in (k, k + 2, k + 4, 32, 34, 64, 66, 16, 18):  # low in a binade: the widest window of quotients
        target = f32(np.sign(v) * (kk + 0.5))
        s0 = f32(v / target)
        for step in range(0, 400):
            s = s0 + f32(step // 2 * (1 if step % 2 else -1)) * np.spacing(s0)
            if f32(f32(v) / s) == target:
                return float(s)
    raise AssertionError("no tie scale found")


def test_build_gives_every_site_its_rule_and_scale(bank):
    block = _block(bank, "0")
    for site, (name, rounding) in RULES.items():
        module = block.norm if site == "norm" else getattr(block, site)
        assert module.out == QuantOut(getattr(SCALES, name), rounding), site
    assert block.out_proj.out == FloatOut(torch.float16)
    assert block.conv1d.input_rule.kind == "static" and block.conv1d.input_rule.scale == SCALES.s_xz
    assert block.u_input.s_u == SCALES.s_u and block.u_input.ssm_u == "int8" and block.u_input.xproj_requant
    assert block.ssm.out == FloatOut(torch.float16) and block.ssm.order.value == "kernel"


@pytest.mark.parametrize("mode, site", sorted(EPILOGUES))
def test_build_gives_every_gemm_its_epilogue(bank, mode, site):
    assert getattr(_block(bank, mode), site).order is EPILOGUES[(mode, site)]


def _tie_code(bank, site: str, scale: str, x, k: int):
    """Block "0"'s `site` on x with its output scale (field `scale` of SCALES) set so that the largest
    value is an exact tie: (the code it gets, the quotient value / scale)."""
    probe = copy.copy(getattr(_block(bank, "0"), site))
    probe.out = FloatOut(torch.float32)
    v = probe(x).reshape(-1)
    i = int(v.abs().argmax())
    s = _tie_scale(float(v[i]), k)
    got = getattr(_block(bank, "0", dataclasses.replace(SCALES, **{scale: s})), site)(x).codes.reshape(-1)[i].item()
    return got, f32(v[i].item()) / f32(s)


def test_norm_output_rounds_half_even(bank):
    residual = torch.randn(1, 3, bank.ckpt.dims.d_model, generator=torch.Generator().manual_seed(0))
    got, quotient = _tie_code(bank, "norm", "s_in", residual, 40)
    assert got == _rne(quotient) and got != _rna(quotient)


def test_conv_output_rounds_half_away(bank):
    g = torch.Generator().manual_seed(1)
    x = QTensor(torch.randint(-128, 128, (1, 6, bank.ckpt.dims.d_inner), generator=g, dtype=torch.int8), SCALES.s_xz)
    got, quotient = _tie_code(bank, "conv1d", "s_u", x, 60)
    assert got == _rna(quotient) and got != _rne(quotient)


def test_online_hadamard_rounds_half_away(bank):
    """q = sat8(RNA(t * f32(1/sqrt(n) / s_H))) with t the unnormalized transform in fp32."""
    n = bank.ckpt.dims.d_inner
    y = torch.randn(1, 2, n, generator=torch.Generator().manual_seed(2)).half().float()
    t = hadamard_transform(y, normalized=False).to(torch.float32).reshape(-1)
    i = int(t.abs().argmax())
    factor = f32(1.0) / f32(_tie_scale(float(t[i]), 50))  # t * factor is a tie; find s_H giving that factor
    quotient = f32(t[i].item()) * factor
    assert quotient % 1 == 0.5 or quotient % 1 == -0.5 or (-quotient) % 1 == 0.5
    base = f32((1.0 / np.sqrt(n)) / np.float64(factor))
    s_H = next(float(c) for c in (base + f32(k) * np.spacing(base) for k in range(-50, 51))
               if f32(np.float64(1.0 / np.sqrt(n)) / np.float64(c)) == factor)
    got = _block(bank, "0", dataclasses.replace(SCALES, s_H=s_H)).had(y).codes.reshape(-1)[i].item()
    assert got == _rna(quotient) and got != _rne(quotient)


@pytest.mark.parametrize("mode, knobs, method", [
    ("2-3", {}, "_ssm_u"),               # ssm_u=requant: the fp32 conv output quantized at s_u (RNE)
    ("2-3", {}, "_xproj_input"),         # int8 x_proj after a float conv: quantized at s_u (RNE)
])
def test_requantized_u_rounds_half_even(bank, mode, knobs, method):
    s_u = 2.0 ** -5
    block = _block(bank, mode, dataclasses.replace(SCALES, s_u=s_u))
    k = torch.arange(-6, 6, dtype=torch.float32)
    conv_out = ((k + 0.5) * s_u).reshape(1, 1, -1).repeat(1, 1, bank.ckpt.dims.d_inner // 12)
    codes = getattr(block, method)(conv_out).codes.reshape(-1)[:12]
    assert codes.tolist() == torch.round(k + 0.5).tolist()           # half to even
    assert codes.tolist() != (torch.sign(k + 0.5) * torch.floor((k + 0.5).abs() + 0.5)).tolist()


@pytest.mark.parametrize("mode, knobs", [("0", {"in_proj_out": "fp"}), ("3", {})], ids=["static", "dynamic"])
def test_conv_input_quantization_rounds_half_even(bank, mode, knobs):
    """A float conv input is quantized at s_xz (static) or at f32(max|x| / 127) (dynamic), half to even."""
    step = 2.0 ** -4
    block = _block(bank, mode, dataclasses.replace(SCALES, s_xz=step), **knobs)
    k = torch.arange(-6, 6, dtype=torch.float32) + 0.5
    x = torch.cat([k, torch.tensor([127.0, -3.0])]) * step  # max|x| / 127 == step for the dynamic rule
    x = x.reshape(1, 1, -1).repeat(1, 1, bank.ckpt.dims.d_inner // 14 + 1)[..., :bank.ckpt.dims.d_inner]
    q = block.conv1d.quantize_input(x)
    assert q.scale == step
    assert q.codes.reshape(-1)[:12].tolist() == torch.round(k).tolist()


def _order_value(order, r, s_w, acc):
    r, s_w, acc = f32(r), f32(s_w), f32(acc)
    return f32(s_w * f32(r * acc)) if order is RW else f32(r * f32(s_w * acc))


def _order_case(order, s_w, w_col, grid):
    """(r, row j, code c): with x = c at one input position, output j is a tie of `grid` in `order`
    and rounds differently in the other order."""
    other = WR if order is RW else RW
    rnd = _rne if grid == "int8" else (lambda v: np.float16(v))
    for j in np.argsort(-np.abs(w_col)):
        for c in (127, 113, 97, 89, 73, 61):
            acc = float(c * int(w_col[j]))
            if acc == 0:
                continue
            for k in (40, 44, 52, 58, 62, 70, 76):
                target = f32(np.sign(acc * s_w) * (k + 0.5)) if grid == "int8" else \
                    f32(np.sign(acc * s_w) * (1.0 + (2 * k + 1) * 2.0 ** -11))
                r0 = f32(target / (np.float64(s_w) * acc))
                for step in range(-300, 301):
                    r = r0 + f32(step) * np.spacing(r0)
                    v = _order_value(order, r, s_w, acc)
                    if v == target and rnd(_order_value(other, r, s_w, acc)) != rnd(v):
                        return float(r), int(j), c
    raise AssertionError("no distinguishing case found")


@pytest.mark.parametrize("mode, site", sorted(EPILOGUES))
def test_epilogue_order_is_pinned_by_the_output(bank, mode, site):
    block = _block(bank, mode)
    linear = getattr(block, site)
    w = linear.weight
    out = linear.out
    grid = "int8" if isinstance(out, QuantOut) else "fp16"
    assert grid == "int8" or out.dtype == torch.float16
    m = 0
    r, j, c = _order_case(EPILOGUES[(mode, site)], w.scale, w.codes[:, m].numpy(), grid)
    s_out = out.scale if grid == "int8" else 1.0
    s_x = float(f32(r) * f32(s_out)) if grid == "int8" else r
    if grid == "int8":  # choose s_out a power of two so that f32(s_x / s_out) == r exactly
        s_out = 2.0 ** -6
        s_x = float(f32(r) * f32(s_out))
        name = RULES[site][0]
        linear = getattr(_block(bank, mode, dataclasses.replace(SCALES, **{name: s_out})), site)
    assert f32(s_x / s_out) == f32(r)
    codes = torch.zeros(1, 1, w.shape[1], dtype=torch.int8)
    codes[0, 0, m] = c
    got = linear(QTensor(codes, s_x))
    acc = c * int(w.codes[j, m])
    want = _order_value(EPILOGUES[(mode, site)], r, w.scale, acc)
    if grid == "int8":
        assert got.codes[0, 0, j].item() == _rne(want)
    else:
        assert got[0, 0, j].item() == float(np.float16(want))


def test_dynamic_conv_input_takes_its_scale_per_call(bank):
    """Mode 3 (conv_in=dynamic) re-quantizes the conv input at f32(max|x| / 127) on every call, not at s_xz."""
    block = _block(bank, "3")
    assert block.conv1d.input_rule.kind == "dynamic"
    x = torch.linspace(-2.54, 1.0, bank.ckpt.dims.d_inner).reshape(1, 1, -1)
    q = block.conv1d.quantize_input(x)
    assert q.scale == float(f32(2.54 / 127.0)) != SCALES.s_xz
    assert block.conv1d.quantize_input(x * 2).scale == float(f32(5.08 / 127.0))
    assert _block(bank, "0").conv1d.input_rule.kind == "static"
