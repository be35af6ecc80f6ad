"""--device cuda leaves no tensor behind on the CPU: every mode, every layer and tap, isolated and end to end, on a
stand-in GPU (tests/fixtures/devcheck.py), so CI, which has no GPU, catches what a CUDA run would raise. The numbers
of such a run are the CPU's and must equal a plain CPU run's bit for bit."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from devcheck import DeviceMix, OnDevice, simulated_cuda

from harness import CalibrationSettings, RunConfig, run
from harness.runtime.guard import Progress

ROOT = Path(__file__).resolve().parents[2]
CASES = {"mamba-tiny": ["all", "1", "q2-w4a8", "q2-w4a16"], "mamba2-tiny": ["all"]}


def _run(model: str, device: str, tmp: Path):
    cfg = RunConfig(model=ROOT / "models" / model, modes=CASES[model], output_file=tmp / f"{device}.npz", seq_len=64,
                    layers=["all"], taps=["all"], isolated=True, end_to_end=True, device=device,
                    calib=CalibrationSettings(num_samples=2, seqlen=64), cache_dir=tmp / "cache")
    return run(cfg, emit=lambda _l: None, progress=Progress())


@pytest.mark.parametrize("model", sorted(CASES))
def test_simulated_cuda_run_places_every_tensor_and_computes_the_cpu_numbers(model, tmp_path, monkeypatch):
    cpu = _run(model, "cpu", tmp_path)
    simulated_cuda(monkeypatch)
    gpu = _run(model, "cuda", tmp_path)
    assert not gpu.failed, f"modes failed on the stand-in GPU: {gpu.failed} (see the captured log)"
    assert gpu.stats["provenance"]["device"] == "cuda"
    for mode, arrays in cpu.by_mode.items():
        assert arrays.keys() == gpu.by_mode[mode].keys()
        for name, a in arrays.items():
            assert np.array_equal(a, gpu.by_mode[mode][name], equal_nan=True), f"{mode} {name}"


def test_the_stand_in_raises_where_cuda_would(monkeypatch):
    simulated_cuda(monkeypatch)
    import harness.runner.forwards as forwards

    with forwards.on_device("cuda"):
        on = torch.zeros(3)
        assert isinstance(on, OnDevice)
        assert isinstance(on + torch.tensor(2.0), OnDevice)      # a 0-dim CPU tensor mixes, as on CUDA
        with pytest.raises(DeviceMix):
            on + torch.ones(3, device="cpu")
        with pytest.raises(DeviceMix):
            on.numpy()
        assert type(on.cpu()) is torch.Tensor and type(on.to("cpu")) is torch.Tensor
        assert isinstance(torch.ones(3, device="cpu").to("cuda") * on, OnDevice)


def test_the_stand_in_divides_by_a_cpu_scalar_as_cuda_does(monkeypatch):
    simulated_cuda(monkeypatch)
    import harness.runner.forwards as forwards

    x = torch.linspace(-7, 7, 10001)
    recip = x * torch.tensor(1.0 / 192.0, dtype=torch.float32)    # CUDA: a multiply by the fp32 reciprocal
    assert not torch.equal(recip, x / 192)                          # ... which the CPU's division is not
    cpu_scalar = torch.tensor(192.0)
    with forwards.on_device("cuda"):
        on = x.to("cuda")
        assert torch.equal((on / 192).cpu(), recip) and torch.equal((on / cpu_scalar).cpu(), recip)
        assert torch.equal((on / torch.tensor(192.0, device="cuda")).cpu(), x / 192)   # a GPU divisor divides
