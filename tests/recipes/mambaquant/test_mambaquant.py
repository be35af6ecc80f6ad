"""MambaQuant (harness.recipes.mambaquant): the transforms are exact (the +transform variant equals fp32), the
quantizers at their points against written-out references, the seeded rotations, the upstream defects as a knob,
the statistics cached and recorded, and the refusals before any work."""
import json

import numpy as np
import pytest
import torch

from harness.architectures.registry import get_architecture
from harness.checkpoints.loading import open_checkpoint
from harness.cli import capture_main
from harness.emulation.modules import EmuBackbone
from harness.kernels.fakequant import fq_asym_rows, percentile_clip_rows
from harness.kernels.field_transforms import klt, random_hadamard
from harness.recipes.mambaquant import mq_options
from harness.recipes.mambaquant.blocks import build, fold_layer, rotations, weight_rtn
from harness.recipes.mambaquant.calibration import calibrate_mq
from harness.recipes.registry import get_mode
from harness.runner.calibration import CalibrationSettings
from harness.runner.weightbank import WeightBank
from conftest import ROOT, SHIPPED
from helpers import FAST_CLI, run_cli, run_modes

SETTINGS = CalibrationSettings(num_samples=4, seqlen=16, batch_size=2)


@pytest.fixture(scope="module")
def setup(hf_dir):
    bank = WeightBank(open_checkpoint(hf_dir))
    windows = torch.randint(0, bank.dims.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    depth = bank.dims.n_layer - 1
    return bank, depth, calibrate_mq(get_mode("mambaquant-w8a8"), bank, windows, SETTINGS, depth, [], None).scales


def _backbone(bank, blocks):
    return EmuBackbone(lambda ids: bank.embed(ids, False, torch.float32), blocks)


def _rel(a, b):
    return float(torch.linalg.vector_norm((a - b).double()) / torch.linalg.vector_norm(b.double()))


def _opts(**kw):
    return {"bits": 8, "quantizer": "mambaquant", "upstream": "as-meant", "seed": 0, **kw}


def _ids(bank, n=24, seed=9):
    return torch.randint(0, bank.dims.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))


def test_transforms_alone_equal_fp32_and_quantized_do_not(setup):
    bank, depth, stats = setup
    mode = get_mode("mambaquant-w8a8")
    ref = _backbone(bank, get_architecture("mamba1").build_blocks(mode, bank, None, depth, False))(_ids(bank))
    same = _backbone(bank, build(mode, bank, stats, depth, _opts(quantizer="none")))(_ids(bank))
    assert _rel(same, ref) <= 1e-5
    quant = _backbone(bank, build(mode, bank, stats, depth, _opts()))(_ids(bank))
    assert 1e-4 < _rel(quant, ref) < 0.5
    # as written, the fp16 rotations make the transforms inexact (R^T R != I in fp16)
    written = _backbone(bank, build(mode, bank, stats, depth, _opts(quantizer="none", upstream="as-written")))(_ids(bank))
    assert _rel(written, ref) > 1e-5


def test_rotations_are_klt_times_seeded_hadamard_and_as_written_accumulate(setup):
    bank, depth, stats = setup
    d = bank.dims
    meant = rotations(stats, 1, d, 0, as_written=False)
    assert torch.equal(meant["R1"], klt(stats[0]["cov_in"]) @ random_hadamard(d.d_model, 1))
    assert torch.equal(meant["R2"], klt(stats[1]["cov_out"]) @ random_hadamard(d.d_inner, 2))
    assert torch.equal(meant["R5"], klt(stats[1]["cov_dt"]) @ random_hadamard(d.dt_rank, 5))
    for r in meant.values():
        assert torch.allclose(r.T @ r, torch.eye(r.shape[0], dtype=torch.float64), atol=1e-10)
    assert torch.equal(rotations(stats, 1, d, 0, False)["R3"], meant["R3"])          # seeded: runs repeat
    assert not torch.equal(rotations(stats, 1, d, 1, False)["R3"], meant["R3"])
    written = rotations(stats, 1, d, 0, as_written=True)
    f16 = lambda t: t.to(torch.float16).to(torch.float64)  # noqa: E731
    k_last = f16(klt(stats[-1]["cov_out"]))                                           # the stale index i = last layer
    h2 = f16(random_hadamard(d.d_inner, 2))
    assert torch.equal(written["R2"], f16(k_last @ f16(k_last @ h2)))                 # accumulated over layers 0, 1
    r5 = f16(f16(klt(stats[0]["cov_dt"])) @ f16(random_hadamard(d.dt_rank, 5)))
    assert torch.equal(written["R5"], f16(f16(klt(stats[1]["cov_dt"])) @ r5))
    assert not torch.equal(written["R2"], rotations(stats, 0, d, 0, as_written=True)["R2"])


def test_quantizers_at_the_points_written_out(setup):
    bank, depth, stats = setup
    block = build(get_mode("mambaquant-w8a8"), bank, stats, 0, _opts())[0]
    p = bank.layer(0, "fp32", False, "exact")
    rot = rotations(stats, 0, bank.dims, 0, False)
    folded = fold_layer(p, stats[0], rot, bank.dims)
    w = block.in_proj.inner.weight
    lo, hi = percentile_clip_rows(folded["in_proj"], 0.999999)
    assert torch.equal(w, fq_asym_rows(folded["in_proj"], 8, lo, hi))
    assert max(len(torch.unique(row)) for row in w) <= 256                 # per row: at most 2^8 levels
    x = torch.randn(2, 5, bank.dims.d_model, generator=torch.Generator().manual_seed(1))
    x[1] *= 50                                                              # per sequence: row 0 keeps its scale
    expected = fq_asym_rows(x @ rot["R1"].to(torch.float32), 8) @ w.T
    assert torch.equal(block.in_proj(x), expected)
    assert torch.allclose(block.in_proj(x[:1]), expected[:1], atol=1e-6)   # the 50x sequence changes nothing here
    r1 = rot["R1"].to(torch.float32)
    assert torch.equal(fq_asym_rows(x @ r1, 8)[0], fq_asym_rows(x[:1] @ r1, 8)[0])
    assert block.norm.weight is None                                       # folded into in_proj


def test_as_written_quantizes_weights_before_the_transforms(setup):
    bank, depth, stats = setup
    p = bank.layer(0, "fp32", False, "exact")
    block = build(get_mode("mambaquant-w8a8"), bank, stats, 0, _opts(upstream="as-written"))[0]
    rot = rotations(stats, 0, bank.dims, 0, True)
    from dataclasses import replace
    early = replace(p, **{n: weight_rtn(getattr(p, n), 8, "mambaquant") for n in ("in_proj", "x_proj", "dt_proj", "out_proj")})
    assert torch.equal(block.out_proj.inner.weight, fold_layer(early, stats[0], rot, bank.dims)["out_proj"])


def test_modes_run_cached_recorded_and_refused_where_undefined(tmp_path, capsys):
    names = ["fp32", "mambaquant-w8a8", "mambaquant-w8a8+quamba", "mambaquant-w8a8+transform"]
    out = run_modes(SHIPPED, tmp_path, names, seq_len=32, layers=[0, 1, 2], end_to_end=True)
    assert all(out.stats["modes"][m]["status"] == "ok" for m in names), out.stats["modes"]
    o, t = out.by_mode["mambaquant-w8a8+transform"]["output"], out.by_mode["fp32"]["output"]
    assert np.linalg.norm(o - t) / np.linalg.norm(t) <= 1e-5
    by = out.stats["provenance"]["calibration_by_prep"]
    assert by["mambaquant"]["statistics"][0]["cov_out"]["shape"] == [384, 384]
    q = by["mambaquant+quamba@seed=0"]
    assert set(q["statistics"][0]) == {f"q_{n}" for n in ("in_proj", "conv", "x_proj", "dt_proj", "out_proj", "h", "C")}
    again = run_modes(SHIPPED, tmp_path, ["mambaquant-w8a8"], seq_len=32)
    assert again.stats["provenance"]["calibration_by_prep"]["mambaquant"]["source"] == "reused"
    rc = run_cli(capture_main, ["--model", ROOT / "models" / "mamba2-tiny", "--modes", "mambaquant-w8a8",
                                "--output_file", tmp_path / "m2.npz", *FAST_CLI])
    err = capsys.readouterr().err
    assert rc == 2 and "MambaQuant" in err and "Mamba-2" in err and not (tmp_path / "m2.npz").exists()


def test_one_calibration_token_exits_2_before_any_work(hf_dir, tmp_path, capsys):
    out = tmp_path / "o.npz"
    rc = run_cli(capture_main, ["--model", hf_dir, "--modes", "mambaquant-w8a8", "--output_file", out,
                                "--seq_len", "8", "--calib_data_num", "1", "--calib_seqlen", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "covariance" in err and "not finite" in err and not out.exists()


def test_options_are_checked(hf_dir, tmp_path, capsys):
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"modes": {"mq-x": {"base": "mambaquant-w8a8", "options": {"upstream": "sometimes"}}}}))
    rc = run_cli(capture_main, ["--model", hf_dir, "--modes", "mq-x", "--modes_file", f, "--output_file",
                                tmp_path / "o.npz", *FAST_CLI])
    assert rc == 2 and "as-meant, as-written" in capsys.readouterr().err
    assert mq_options(get_mode("mambaquant-w8a8+quamba"))["quantizer"] == "quamba"


def test_w4a8_uses_gptq_weights_cached_and_4_bit_conv(hf_dir, tmp_path):
    out = run_modes(hf_dir, tmp_path, ["fp32", "mambaquant-w4a8", "mambaquant-w8a8"], seq_len=16, end_to_end=True)
    assert out.stats["modes"]["mambaquant-w4a8"]["status"] == "ok", out.stats["modes"]["mambaquant-w4a8"]
    info = out.stats["provenance"]["calibration_by_prep"]["mambaquant+gptq4@seed=0"]
    assert {"gptq_in_proj", "gptq_x_proj", "gptq_dt_proj", "gptq_out_proj"} <= set(info["statistics"][0])
    again = run_modes(hf_dir, tmp_path, ["mambaquant-w4a8"], seq_len=16)
    assert again.stats["provenance"]["calibration_by_prep"]["mambaquant+gptq4@seed=0"]["source"] == "reused"
    assert np.array_equal(again.by_mode["mambaquant-w4a8"]["output"], out.by_mode["mambaquant-w4a8"]["output"])
    e2e = {r["mode"]: r for r in out.stats["end_to_end"]["rows"]} if isinstance(out.stats["end_to_end"], dict) \
        and "rows" in out.stats["end_to_end"] else None
    bank = WeightBank(open_checkpoint(hf_dir))
    from harness.recipes.mambaquant import MambaQuant
    calib = MambaQuant().calibrate("mambaquant+gptq4@seed=0", bank, torch.randint(0, 64, (4, 16)), SETTINGS, 0,
                                   ["x"], None)
    block = build(get_mode("mambaquant-w4a8"), bank, calib.scales, 0, mq_options(get_mode("mambaquant-w4a8")))[0]
    assert torch.equal(block.in_proj.inner.weight, calib.scales[0]["gptq_in_proj"])
    conv = block.conv1d.inner.weight
    assert max(len(torch.unique(row)) for row in conv) <= 16  # 4-bit per channel
    assert e2e is None or "mambaquant-w4a8" in e2e


def test_decode_runs_the_wrapped_blocks_and_refuses_mambaquant_by_name(hf_dir, tmp_path):
    out = run_modes(hf_dir, tmp_path, ["fp32", "naive-static", "mambaquant-w8a8"], seq_len=12, decode=2)
    modes = out.stats["modes"]
    assert modes["naive-static"]["status"] == "ok", modes["naive-static"]
    assert modes["mambaquant-w8a8"]["status"] != "ok"
    assert "no decode step" in modes["mambaquant-w8a8"]["error"] and "without --decode" in modes["mambaquant-w8a8"]["error"]
    assert any(k.startswith("mode_naive-static__decode") or "decode" in k for k in out.by_mode["naive-static"])


def test_quamba_quantizer_variant_is_static_per_tensor_on_the_transformed_model(hf_dir):
    from harness.kernels.fakequant import fq_sym, fq_sym_dynamic
    from harness.recipes.mambaquant import MambaQuant
    bank = WeightBank(open_checkpoint(hf_dir))
    windows = torch.randint(0, bank.dims.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    calib = MambaQuant().calibrate("mambaquant+quamba@seed=0", bank, windows, SETTINGS, 0, ["x"], None)
    layer = calib.scales[0]
    # the static scale of in_proj's input: max |x R1| / 127 over the windows, on the transformed fp model (its norm
    # weight folded into in_proj: x is the unweighted norm output)
    rot = rotations(calib.scales, 0, bank.dims, 0, False)
    seen = []
    blocks = get_architecture("mamba1").build_blocks(get_mode("mambaquant-w8a8"), bank, None, 0, False)
    wn = blocks[0].norm.weight
    blocks[0].norm.register_forward_hook(
        lambda _m, _i, out: seen.append(float(((out / wn) @ rot["R1"].float()).abs().max())))
    model = _backbone(bank, blocks)
    for batch in windows.split(2):
        model(batch)
    assert layer["q_in_proj"] == pytest.approx(max(seen) / 127, rel=1e-5)
    mode = get_mode("mambaquant-w8a8+quamba")
    block = build(mode, bank, calib.scales, 0, mq_options(mode),
                  scales=[{n: layer[f"q_{n}"] for n in ("in_proj", "conv", "x_proj", "dt_proj", "out_proj", "h", "C")}])[0]
    w = fq_sym_dynamic(fold_layer(bank.layer(0, "fp32", False, "exact"), layer, rot, bank.dims)["in_proj"])
    assert torch.equal(block.in_proj.inner.weight, w) and len(torch.unique(w)) <= 255   # one scale per tensor
    x = torch.randn(1, 5, bank.dims.d_model, generator=torch.Generator().manual_seed(2))
    assert torch.equal(block.in_proj(x), fq_sym(x @ rot["R1"].to(torch.float32), layer["q_in_proj"]) @ w.T)
