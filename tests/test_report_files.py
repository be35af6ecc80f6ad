"""The report's files: permissions from the umask, and never written over a file the report did not write."""
from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from harness.report.build import write_report
from harness.store.format import write_npz

RNG = np.random.default_rng(3)


@pytest.fixture
def capture(tmp_path):
    """A small research-tool file whose mode 0 differs from fp32 (so the report draws one figure)."""
    ref = RNG.standard_normal((1, 8, 4)).astype(np.float32)
    path = tmp_path / "run.npz"
    write_npz(path, {"mode_fp32_output": ref, "mode_0_output": ref * np.float32(1.01)})
    return path


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_report_and_figures_follow_the_umask(capture, tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        out = write_report(capture, tmp_path / "r.html", figures_dir=tmp_path / "figs")
    finally:
        os.umask(old)
    files = [out, *sorted((tmp_path / "figs").iterdir())]
    assert len(files) == 3  # the report, tensor_output.png and .svg
    assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in files} == {f.name: mode for f in files}
