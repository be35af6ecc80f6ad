"""Issue "fast and lean": the shortcuts (early exit, lazy loading, shared preparation) change no bit."""
import numpy as np
import pytest
import torch

from conftest import make_hf_model, write_hf_dir
from harness.runner.backbone import build_backbone
from harness.recipes.quamba.calibration import run_observers
from harness.emulation.capture import capture
from harness.checkpoints.text import DEFAULT_CALIB_FILE, DEFAULT_TEXT_FILE, calibration_windows, read_sample
from harness.checkpoints.tokenizer import load_tokenizer
from harness.checkpoints.loading import open_checkpoint
from harness.modes import BUILTIN_MODES
from harness.runner.weightbank import WeightBank
from helpers import run_modes

POINTS = ["L0.block.in", "L0.block.out", "L0.block.residual", "L0.ssm.u", "L0.had.out"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_hf_dir(tmp_path_factory.mktemp("lean") / "m3", make_hf_model(d_model=24, n_layer=3, seed=3))


def _captures(bank, scales, depth, ids, mode):
    model = build_backbone(BUILTIN_MODES[mode], bank, scales, depth)
    with capture(model, POINTS) as got:
        model(ids)
    return {k: v.values for k, v in got.items()}


@pytest.mark.parametrize("mode", ["fp32", "1", "0", "2-4", "3"])
def test_early_exit_equals_the_full_model(model_dir, mode):
    ckpt = open_checkpoint(model_dir)
    tok = load_tokenizer(model_dir)
    windows = calibration_windows(tok, DEFAULT_CALIB_FILE, 4, 32, 0).ids
    ids = read_sample(tok, DEFAULT_TEXT_FILE, 40).ids
    bank = WeightBank(ckpt)
    scales_full, _ = run_observers(bank, windows, 2, 0.9995, 4)
    scales_l0, _ = run_observers(WeightBank(ckpt), windows, 0, 0.9995, 4)
    assert scales_full[0] == scales_l0[0]  # calibrating deeper layers does not touch layer 0's scales
    early = _captures(bank, scales_l0, 0, ids, mode)
    full = _captures(bank, scales_full, 2, ids, mode)
    assert early.keys() == full.keys() and len(early) >= 4
    for name in early:
        assert torch.equal(early[name], full[name]), name


def test_lazy_loading_equals_full_loading(model_dir, tmp_path):
    """The mmap-backed checkpoint against one whose every tensor was first read into memory."""
    from safetensors.torch import load_file

    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    lazy = run_modes(model_dir, tmp_path / "a", ["fp32", "0", "2-3"], taps=["all"])
    everything = load_file(str(model_dir / "model.safetensors"))

    class Eager(dict):
        def get_tensor(self, key):
            return self[key]

    import harness.checkpoints.loading as loading

    original = loading._open_weights
    loading._open_weights = lambda file: Eager(everything)
    try:
        eager = run_modes(model_dir, tmp_path / "b", ["fp32", "0", "2-3"], taps=["all"])
    finally:
        loading._open_weights = original
    for mode in ("fp32", "0", "2-3"):
        for name, arr in lazy.by_mode[mode].items():
            assert np.array_equal(arr, eager.by_mode[mode][name]), (mode, name)


def test_only_needed_tensors_are_read(model_dir, tmp_path):
    out = run_modes(model_dir, tmp_path, ["fp32", "0"])
    read = out.stats["provenance"]["model"]["tensors_read"]
    assert read["count"] == 1 + 10 and all(not k.startswith("backbone.layers.1.") for k in read["keys"])
    sd = open_checkpoint(model_dir)
    expected = sum(sd.tensor(k).numel() * 4 for k in read["keys"])  # fp32 checkpoint
    assert read["bytes"] == expected
    deeper = sum(sd.tensor(k).numel() * 4 for k in sd.keys() if k.startswith(("backbone.layers.1.", "backbone.layers.2.")))
    assert read["checkpoint_bytes"] >= expected + deeper
