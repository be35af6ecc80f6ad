"""harness.kernels.portable: accurate, and the same bits on every CPU.

The functions are built from single IEEE operations, so their bits are recorded here once
(HASHES) and must hold on any machine: inputs come from numpy's PCG64 (portable), and a
mismatch means some platform rounds a basic operation differently. The subprocess test
re-runs them under every code path this machine offers (ATen's vector widths, MKL's paths).
"""
import hashlib
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from harness.kernels import portable

SPECIALS = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-30, -1e-30, 88.72, 88.73, -87.3, -103.9, -104.0, 20.0, 20.5]


def _inputs() -> torch.Tensor:
    x = np.random.default_rng(7).standard_normal(1 << 16).astype(np.float32) * 8
    x[:len(SPECIALS)] = SPECIALS
    return torch.from_numpy(x)


def _outputs() -> dict[str, torch.Tensor]:
    x = _inputs()
    return {"exp": portable.exp(x), "log1p": portable.log1p(portable.exp(x)), "sigmoid": portable.sigmoid(x),
            "silu": portable.silu(x), "softplus": portable.softplus(x), "sqrt": portable.sqrt(x.abs()),
            "sum_last": portable.sum_last(x.reshape(-1, 64)[:, :61])}


def _hashes() -> dict[str, str]:
    return {k: hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest()[:16] for k, v in _outputs().items()}


# recorded on an AVX-512 Xeon; by construction the same on every CPU (module docstring)
HASHES = {"exp": "533c426b4bf5bb29", "log1p": "aefd37ca94e076eb", "sigmoid": "6d6b0524abc59447",
          "silu": "5ba8085221773568", "softplus": "0eb4138a31f97aa1", "sqrt": "e4389028a1a73de5",
          "sum_last": "2c304d782e897110"}


def _ulps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of fp32's spacing at want (want: float64, finite, nonzero)."""
    spacing = torch.nextafter(want.float().abs(), torch.tensor(math.inf)).double() - want.float().abs().double()
    return (got.double() - want).abs() / spacing


def test_exp_is_correctly_rounded_on_samples():
    x = _inputs()[len(SPECIALS):]
    x = x[(x > -87) & (x < 88)]
    assert _ulps(portable.exp(x), x.double().exp()).max() <= 0.5 + 1e-6


def test_log1p_softplus_sigmoid_and_sqrt_are_accurate():
    x = _inputs()[len(SPECIALS):]
    e = portable.exp(x)
    fin = torch.isfinite(e) & (e > 0)
    assert _ulps(portable.log1p(e)[fin], e[fin].double().log1p()).max() <= 0.5 + 1e-6
    s = portable.sqrt(x.abs())
    assert torch.equal(s, x.abs().double().sqrt().float())  # correctly rounded: double sqrt rounds once to fp32
    sp = portable.softplus(x)
    torch.testing.assert_close(sp, torch.nn.functional.softplus(x), rtol=3e-7, atol=0)
    torch.testing.assert_close(portable.sigmoid(x), torch.sigmoid(x), rtol=5e-7, atol=1e-30)
    torch.testing.assert_close(portable.silu(x), torch.nn.functional.silu(x), rtol=5e-7, atol=1e-30)


def test_special_values():
    x = torch.tensor(SPECIALS, dtype=torch.float32)
    e = portable.exp(x)
    assert math.isnan(e[0]) and e[1] == math.inf and e[2] == 0 and e[3] == 1 and e[4] == 1
    assert e[8] == math.inf and e[10] > 0 and e[11] == 0  # overflow past 88.7228, subnormal, underflow
    sp = portable.softplus(x)
    assert math.isnan(sp[0]) and sp[1] == math.inf and sp[2] == 0 and sp[13] == 20.5
    assert portable.log1p(torch.tensor([0.0, 1e-30, math.inf]))[1] == pytest.approx(1e-30, rel=1e-7)
    assert portable.sqrt(torch.tensor([0.0, math.inf, 4.0])).tolist() == [0.0, math.inf, 2.0]


def test_sum_last_is_a_fixed_pairwise_sum():
    """Halving: x[..., :h] + x[..., h:] until one is left, after padding with -0.0 to a power of two."""
    y = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(1))
    want = y
    while want.shape[-1] > 1:
        h = want.shape[-1] // 2
        want = want[..., :h] + want[..., h:]
    assert torch.equal(portable.sum_last(y), want)
    # [1, 1e8, 1, -1e8]: pairs (1 + 1) + (1e8 - 1e8) = 2, where a left-to-right fp32 sum gives 0
    assert portable.sum_last(torch.tensor([[1.0, 1e8, 1.0, -1e8]])).item() == 2.0
    z = torch.tensor([[-0.0, -0.0, -0.0]])
    assert torch.signbit(portable.sum_last(z)).all()  # -0.0 padding keeps the sign of a sum of -0.0


def test_recorded_bits_hold_on_this_machine():
    assert _hashes() == HASHES


def _code_paths() -> list[dict[str, str]]:
    """Environment settings that change torch's code paths on this machine (each only where it exists)."""
    paths = [{"ATEN_CPU_CAPABILITY": "default"}]
    cap = torch.backends.cpu.get_cpu_capability()
    if cap in ("AVX512", "AVX2"):
        paths.append({"ATEN_CPU_CAPABILITY": "avx2"})
    if torch.backends.mkl.is_available():
        paths += [{"MKL_CBWR": "COMPATIBLE"}, {"MKL_CBWR": "AVX2"}] if cap in ("AVX512", "AVX2") else [{"MKL_CBWR": "COMPATIBLE"}]
    return paths


@pytest.mark.parametrize("env", _code_paths(), ids=lambda e: ",".join(f"{k}={v}" for k, v in e.items()))
def test_same_bits_under_every_code_path(env):
    code = "import json, tests.kernels.test_portable as t; print(json.dumps(t._hashes()))"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert json.loads(out.stdout) == _hashes()


def test_other_float_dtypes_are_rounded_to_fp32_first():
    """exp and log1p take fp32 values: a float64 input is rounded to fp32 first and the result is fp32
    (mutants that kept float64 survived)."""
    x = torch.from_numpy(np.random.default_rng(3).uniform(-8, 8, 4096))   # float64, most not fp32 values
    for f, arg in ((portable.exp, x), (portable.log1p, x.abs())):
        got, want = f(arg), f(arg.to(torch.float32))
        assert got.dtype == torch.float32 and torch.equal(got, want)
