"""prep=exact reproduces the recorded arrays of every built-in mode on any CPU, within a measured tolerance.

tests/data/golden_exact.json holds a fingerprint of every captured array (both layers, every
tap) of every built-in mode re-defined with prep=exact, written by
tests/data/make_golden_exact.py on an AVX-512 Xeon. A fingerprint (L2 norm and four
projections on fixed +-1 vectors) survives a change of CPU where a sha256 does not; the
deviation is about the relative L2 error of a change.

The model's weights are drawn with numpy's PCG64 (make_golden_exact.portable_model): torch's
normal_ gives other values in ATen's scalar build, and weights that differ by 1e-7 moved a
layer-1 int8 code and that layer's output by 1.9e-2.

Tolerances, from the deviations measured on one machine by changing only the code path
(docs/determinism.md): every quantized mode was bit-identical under ATen's scalar and AVX2
builds and MKL's AVX2 and COMPATIBLE paths; fp32 and mode 1 moved by up to 7.4e-7 through
MKL's float GEMMs (COMPATIBLE). The float modes get 1e-3. The quantized modes get 5e-2:
their calibration runs float GEMMs too, and where a scale moves by a last bit on another CPU
codes flip (the weights experiment above: 1.9e-2); a wrong rounding rule, scale or op order
moves them further (tests/recipes/quamba/test_mode_contracts.py and the kernel oracles check those bit for bit).
"""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "data"))
from make_golden_exact import MODES, capture, deviation, exact_modes_file  # noqa: E402

GOLDEN = json.loads((Path(__file__).resolve().parents[2] / "data" / "golden_exact.json").read_text())
FLOAT_MODES = {"fp32", "1"}
TOLERANCE = {"float": 1e-3, "quantized": 5e-2}


@pytest.fixture(scope="module")
def fingerprints(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("golden")
    return capture(tmp, exact_modes_file(tmp / "exact.json"))


@pytest.mark.parametrize("mode", MODES)
def test_prep_exact_reproduces_the_recorded_arrays(fingerprints, mode):
    golden = GOLDEN["modes"][mode]
    assert set(fingerprints[mode]) == set(golden)
    tol = TOLERANCE["float" if mode in FLOAT_MODES else "quantized"]
    off = {name: deviation(fingerprints[mode][name], golden[name]) for name in golden}
    assert {name: d for name, d in off.items() if not d <= tol} == {}, f"mode {mode}: deviation over {tol}"


def test_deviation_sees_a_change_the_tolerance_would_not_pass():
    """A fingerprint moves with the array: a shifted copy and a 1 % scale error are far outside the tolerances."""
    import numpy as np

    from make_golden_exact import fingerprint
    a = np.random.default_rng(0).standard_normal((1, 80, 48)).astype(np.float32)
    assert deviation(fingerprint(a), fingerprint(a)) == 0.0
    assert deviation(fingerprint(a * 1.01), fingerprint(a)) > TOLERANCE["float"]
    assert deviation(fingerprint(np.roll(a, 1, axis=1)), fingerprint(a)) > TOLERANCE["quantized"]
    assert deviation(fingerprint(a[:, :79]), fingerprint(a)) == float("inf")
