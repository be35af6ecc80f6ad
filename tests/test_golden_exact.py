"""prep=exact reproduces the arrays of the code before the `prep` knob existed, bit for bit.

tests/data/golden_exact.json holds the sha256 of every captured array (both layers,
every tap) of every built-in mode, written by tests/data/make_golden_exact.py from
commit 741a2d5. Here each built-in mode is re-defined with prep=exact and must give
the same bytes: exact preparation, the calibration model and every op order of then.
"""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "data"))
from make_golden_exact import MODES, capture, exact_modes_file  # noqa: E402

GOLDEN = json.loads((Path(__file__).parent / "data" / "golden_exact.json").read_text())


@pytest.fixture(scope="module")
def digests(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("golden")
    return capture(tmp, exact_modes_file(tmp / "exact.json"))


@pytest.mark.parametrize("mode", MODES)
def test_prep_exact_reproduces_the_arrays_of_before(digests, mode):
    golden = GOLDEN["modes"][mode]
    assert set(digests[mode]) == set(golden)
    differing = [name for name in golden if digests[mode][name] != golden[name]]
    assert differing == [], f"mode {mode} with prep=exact changed {differing}"
