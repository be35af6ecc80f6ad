"""--device cuda computes what --device cpu computes (issue 36): every mode of both shipped models, every layer,
every tap, isolated and end to end, run twice on the same machine with the same calibration (one cache).

The int8 taps must hold the same codes; the float taps are reported in units in the last place (ULPs) and relative
L2, and must stay within the bound the float modes are held to across CPUs (docs/determinism.md: 1e-3). With
QUAMBA_CUDA_REPORT=DIR every tap's difference is written to DIR/cuda_parity_<model>.json (docs/gpu.md quotes it).
Skipped, with its reason, where torch sees no CUDA device.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from parity import compare_modes

from harness import CalibrationSettings, RunConfig, run
from harness.runtime.guard import Progress

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device: torch sees none here (docs/gpu.md)")

# model -> the modes it runs (every built-in mode of its architecture)
CASES = {"mamba-tiny": ["all", "1", "q2-w4a8", "q2-w4a16"], "mamba2-tiny": ["all"]}
FLOAT_BOUND = 1e-3
# `L{i}.block.isolated` of a quantized mode is that block run on the fp32 mode's own activations, which a GPU computes
# with other GEMM orders (relative L2 <= 6.1e-7 on an H200): quantizing them flips an int8 code here and there inside
# the block. Measured on an H200: up to 3.6e-3 (mamba-tiny and mamba2-tiny, layer 1).
ISOLATED_BOUND = 1e-2


def _bound(tap: str) -> float:
    return ISOLATED_BOUND if tap.endswith(".block.isolated") else FLOAT_BOUND


def _run(model: str, device: str, tmp: Path) -> tuple[dict, dict]:
    cfg = RunConfig(model=ROOT / "models" / model, modes=CASES[model], output_file=tmp / f"{model}_{device}.npz",
                    seq_len=256, layers=["all"], taps=["all"], isolated=True, end_to_end=True, device=device,
                    calib=CalibrationSettings(num_samples=8, seqlen=256), cache_dir=tmp / "cache")
    out = run(cfg, emit=lambda _line: None, progress=Progress())
    assert not out.failed, f"{model} on {device}: modes failed: {out.failed}"
    return out.by_mode, out.stats


@pytest.mark.parametrize("model", sorted(CASES))
def test_cuda_matches_cpu(model, tmp_path):
    cpu, stats = _run(model, "cpu", tmp_path)      # calibrates into tmp_path/cache
    cuda, _ = _run(model, "cuda", tmp_path)        # reads the same scales
    diffs = compare_modes(cpu, cuda, stats)
    report = os.environ.get("QUAMBA_CUDA_REPORT")
    if report:
        Path(report).mkdir(parents=True, exist_ok=True)
        (Path(report) / f"cuda_parity_{model}.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
             "taps": [d.as_dict() for d in diffs]}, indent=1))
    codes = [f"{d.mode} {d.tap}: {d.codes_differ} of {d.size}" for d in diffs if d.codes_differ]
    assert not codes, "int8 codes differ between cpu and cuda:\n" + "\n".join(codes)
    far = [f"{d.mode} {d.tap}: rel L2 {d.rel_l2:.2e}, {d.max_ulp} ULP" for d in diffs if d.rel_l2 > _bound(d.tap)]
    assert not far, "float taps beyond the cross-CPU bound:\n" + "\n".join(far)
    assert len(diffs) > 100  # every tap of every mode was compared
