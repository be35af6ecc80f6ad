"""The naive W8A8 baselines (harness.recipes.naive): their quantizers at their points on crafted inputs, their
calibration (cached, recorded), and whole runs on seeded Mamba-1 and Mamba-2 models."""
import numpy as np
import pytest
import torch

from harness.emulation.fakequant import Wrap
from harness.kernels.fakequant import fq_sym, fq_sym_dynamic
from harness.checkpoints.loading import open_checkpoint
from harness.recipes.naive import calibrate_static
from harness.recipes.naive.blocks import STATIC_POINTS, build_dynamic, build_static, static_scale
from harness.recipes.registry import get_mode, recipe_for
from harness.runner.calibration import CalibrationSettings
from harness.runner.weightbank import WeightBank
from helpers import run_modes
from conftest import ROOT, SHIPPED

TINY2 = ROOT / "models" / "mamba2-tiny"  # the shipped trained Mamba-2

SETTINGS = CalibrationSettings(num_samples=4, seqlen=16, batch_size=2)


@pytest.fixture(scope="module")
def bank(hf_dir):
    return WeightBank(open_checkpoint(hf_dir))


def _windows(bank, n=4, L=16, seed=0):
    return torch.randint(0, bank.dims.vocab_size, (n, L), generator=torch.Generator().manual_seed(seed))


def test_static_scales_are_the_running_absmax_over_127_and_are_cached(bank, tmp_path):
    windows = _windows(bank)
    first = calibrate_static(bank, windows, SETTINGS, 1, ["a", "b"], tmp_path)
    again = calibrate_static(bank, windows, SETTINGS, 1, ["a", "b"], tmp_path)
    assert first.info["source"] == "computed" and again.info["source"] == "reused"
    assert len(first.info["cache_files"]) == 2 and first.scales == again.scales
    assert set(first.scales[0]) == set(STATIC_POINTS["mamba1"])
    # mamba_in is the in_proj input, the fp32 norm output: its absmax, seen independently through a forward hook
    from harness.emulation.modules import EmuBackbone
    from harness.recipes.naive.blocks import float_blocks
    seen = []
    blocks = float_blocks(get_mode("naive-static"), bank, 0)
    blocks[0].norm.register_forward_hook(lambda _m, _i, out: seen.append(float(out.abs().max())))
    model = EmuBackbone(lambda ids: bank.embed(ids, False, torch.float32), blocks)
    for batch in windows.split(2):
        model(batch)
    assert first.scales[0]["mamba_in"] == static_scale(max(seen))
    assert static_scale(max(seen)) == pytest.approx(max(seen) / 127, rel=1e-7)


def test_static_block_quantizes_inputs_at_the_scale_and_weights_per_tensor(bank):
    mode = get_mode("naive-static")
    scales = [{p: 0.01 * (k + 1) for k, p in enumerate(STATIC_POINTS["mamba1"])}]
    block = build_static(mode, bank, scales, 0)[0]
    assert isinstance(block.in_proj, Wrap) and isinstance(block.ssm, Wrap) and isinstance(block.out_proj, Wrap)
    w = block.in_proj.inner.weight
    raw = bank.layer(0, "fp32", False, "exact").in_proj
    assert torch.equal(w, fq_sym_dynamic(raw)) and len(torch.unique(w)) <= 255
    assert w is not raw and torch.equal(raw, bank.layer(0, "fp32", False, "exact").in_proj)  # the bank is untouched
    x = torch.randn(1, 5, bank.dims.d_model, generator=torch.Generator().manual_seed(3))
    assert torch.equal(block.in_proj(x), fq_sym(x, 0.01) @ w.T)
    # B is the scan's 3rd operand, quantized at the "B" scale (index 6 -> 0.07)
    B = torch.randn(1, 5, bank.dims.d_state)
    assert torch.equal(block.ssm.ins[2](B), fq_sym(B, 0.07))
    assert torch.equal(block.ssm.inner.A_log, fq_sym_dynamic(bank.layer(0, "fp32", False, "exact").A_log))


def test_dynamic_block_is_ptq_ssm_w8a8linear(bank):
    block = build_dynamic(get_mode("naive-dynamic"), bank, 0)[0]
    x = torch.randn(1, 5, bank.dims.d_model, generator=torch.Generator().manual_seed(4)) * 3
    raw = bank.layer(0, "fp32", False, "exact").in_proj
    wq = fq_sym_dynamic(raw, clamp=False)
    expected = fq_sym_dynamic(fq_sym_dynamic(x, clamp=False) @ wq.T, clamp=False)
    assert torch.equal(block.in_proj(x), expected)
    # dt_proj's output is quantized with its bias (HF's Linear): fq(y + b) - b
    dt = torch.randn(1, 5, bank.dims.dt_rank)
    b = block.ssm.dt_bias
    y = fq_sym_dynamic(dt, clamp=False) @ block.dt_proj.inner.weight.T
    assert torch.allclose(block.dt_proj(dt) + b, fq_sym_dynamic(y + b, clamp=False), atol=1e-6)
    assert recipe_for(get_mode("naive-dynamic")).calibration_key(get_mode("naive-dynamic")) is None


@pytest.mark.parametrize("arch", ["mamba1", "mamba2"])
def test_both_baselines_run_on_both_shipped_models(arch, tmp_path):
    model_dir = SHIPPED if arch == "mamba1" else TINY2
    out = run_modes(model_dir, tmp_path, ["fp32", "naive-static", "naive-dynamic"], seq_len=16, layers=[0, 1],
                    end_to_end=True)
    modes = out.stats["modes"]
    assert all(modes[m]["status"] == "ok" for m in ("naive-static", "naive-dynamic")), modes
    info = out.stats["provenance"]["calibration_by_prep"]["naive-static"]
    assert info["options"] == {"architecture": arch} and set(info["statistics"][0]) == set(STATIC_POINTS[arch])
    e2e = out.stats["end_to_end"]
    for m in ("naive-static", "naive-dynamic"):  # quantized: close to, not equal to fp32
        assert np.isfinite(out.by_mode[m]["output"]).all()
        assert not np.array_equal(out.by_mode[m]["output"], out.by_mode["fp32"]["output"])
    assert e2e is not None


def test_options_a_family_does_not_take_exit_2(hf_dir, tmp_path, capsys):
    import json
    from harness.cli import capture_main
    from helpers import FAST_CLI, run_cli
    f = tmp_path / "m.json"
    for spec, says in (({"base": "0", "options": {"alpha": 0.5}}, "recipe 'quamba1' takes no options"),
                       ({"base": "naive-static", "options": {"quantizer": "odd"}}, "quantizer = static or dynamic")):
        f.write_text(json.dumps({"modes": {"m-x": spec}}))
        rc = run_cli(capture_main, ["--model", hf_dir, "--modes", "m-x", "--modes_file", f, "--output_file",
                                    tmp_path / "o.npz", *FAST_CLI])
        err = capsys.readouterr().err
        assert rc == 2 and says in err and "m-x" in err and not (tmp_path / "o.npz").exists(), err
    f.write_text(json.dumps({"modes": {"m-x": {"base": "naive-static", "options": "alpha"}}}))
    rc = run_cli(capture_main, ["--model", hf_dir, "--modes", "m-x", "--modes_file", f, "--output_file",
                                tmp_path / "o.npz", *FAST_CLI])
    assert rc == 2 and "options must be a table" in capsys.readouterr().err


def test_a_corrupted_or_non_finite_cache_entry_is_recomputed_never_used(bank, tmp_path, capsys):
    import json as _json
    windows = _windows(bank)
    first = calibrate_static(bank, windows, SETTINGS, 0, ["a"], tmp_path)
    path = first.info["cache_files"][0]
    with np.load(path) as z:
        members = {k: z[k] for k in z.files}
    header = _json.loads(members["__entry__"].tobytes())
    header["payload"]["floats"]["u"] *= 2  # a silent edit: the checksum fails
    members["__entry__"] = np.frombuffer(_json.dumps(header).encode(), np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **members)
    again = calibrate_static(bank, windows, SETTINGS, 0, ["a"], tmp_path)
    assert again.info["source"] == "recomputed" and "checksum" in again.info["reason"]
    assert again.scales == first.scales and "recomputing the calibration" in capsys.readouterr().err
    from harness.runner.statcache import cached_statistics
    with pytest.raises(ValueError, match="not finite in layer 0: x"):
        cached_statistics("t", "t", windows, SETTINGS, 0, ["a"], tmp_path, compute=lambda: [{"x": float("nan")}])
    assert not list(tmp_path.glob("t-*"))  # never cached
