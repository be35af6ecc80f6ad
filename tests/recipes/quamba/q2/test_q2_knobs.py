"""Quamba2's variant knobs (docs/modes.md "Variant knobs of q2-w8a8"): each changes exactly what it says, the
defaults are q2-w8a8 as it was, and a Mamba-1 recipe asking for them is exit 2."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import ROOT
from harness.checkpoints.loading import open_checkpoint
from harness.cli import capture_main
from harness.runner.backbone import build_backbone
from harness.recipes.quamba.q2.build import build_q2_mamba2_block
from harness.emulation.capture import MAMBA2_POINTS, capture
from harness.recipes.quamba.q2.block import build_q2_block
from harness.kernels.conv1d_grouped import q2_conv1d_ref
from harness.kernels.ssd import ssd_chunked, ssd_ref
from harness.recipes.quamba.q2.params import q2_params
from harness.modes import ModeError, load_modes_file
from harness.recipes.registry import get_mode
from harness.runner.calibration import CalibrationSettings
from harness.recipes.quamba.families import calibrate_key as calibrate
from harness.runner.resume import recorded_recipe
from harness.runner.weightbank import WeightBank
from harness.store.reader import load_capture
from helpers import on_grid, run_cli

from mamba2_fixtures import make_mamba2

SEQ = 21  # chunk_size 8: two chunk boundaries inside the sample
SETTINGS = CalibrationSettings(num_samples=6, seqlen=SEQ, batch_size=4)
TINY2 = ROOT / "models" / "mamba2-tiny"
BEFORE_CONV = ("block.in", "norm.out", "in_proj.z", "in_proj.xBC", "in_proj.dt")


@pytest.fixture(scope="module", params=[1, 2], ids=["ngroups1", "ngroups2"])
def model(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"q2k{request.param}")
    make_mamba2(out, ngroups=request.param, layers=2, seed=20 + request.param, headdim=4)
    bank = WeightBank(open_checkpoint(out))
    windows = torch.randint(0, 64, (SETTINGS.num_samples, SEQ), generator=torch.Generator().manual_seed(request.param))
    return bank, windows, calibrate(bank, windows, SETTINGS, 1, [], None, "quamba2")


def _taps(backbone, ids, layers=(0, 1)) -> dict[str, torch.Tensor]:
    names = [f"L{i}.{p}" for i in layers for p in MAMBA2_POINTS]
    with capture(backbone, names) as cap:
        out = backbone(ids)
    return {**{k: v.values for k, v in cap.items()}, "out": out}


def _variant(**knobs):
    return replace(get_mode("q2-w8a8"), name="v", **knobs)


def test_the_defaults_are_q2_w8a8_as_it_was(model):
    """Spelled-out defaults build what the pre-knob call builds (grouped table, state int8), and the built-in
    mode's recorded recipe holds no new key (its stats do not move)."""
    bank, windows, calib = model
    d = bank.dims
    spelled = _variant(x_groups="grouped", state_dtype="int8")
    assert spelled.knobs() == get_mode("q2-w8a8").knobs() and "x_groups" not in spelled.knobs()
    ids = windows[:2]
    new = _taps(build_backbone(spelled, bank, calib.scales, 1), ids)
    old_blocks = [build_q2_block(i, d, q2_params(bank.raw(i), calib.scales[i], d), calib.scales[i], True)
                  for i in range(2)]
    old = build_backbone(get_mode("q2-w8a8"), bank, calib.scales, 1)
    old.blocks = torch.nn.ModuleList(old_blocks)
    before = _taps(old, ids)
    assert new.keys() == before.keys() and all(torch.equal(new[k], before[k]) for k in new)


def test_x_groups_tensor_quantizes_x_at_one_percentile_scale(model):
    """x_groups=tensor: every x channel at s_x_tensor (Quamba's non-grouped percentile observer of x_conv_out,
    written out: per sample torch.quantile(|x|, alpha) of the fp16 values, EMA 0.01, / 127); everything before
    the conv's x output and the conv's B and C bit-identical to the grouped run."""
    bank, windows, calib = model
    d = bank.dims
    ids = windows[:2]
    grouped = _taps(build_backbone(get_mode("q2-w8a8"), bank, calib.scales, 1), ids)
    tensor = _taps(build_backbone(_variant(x_groups="tensor"), bank, calib.scales, 1), ids)
    for p in BEFORE_CONV + ("conv1d.B", "conv1d.C"):
        assert torch.equal(tensor[f"L0.{p}"], grouped[f"L0.{p}"]), p
    for i, s in enumerate(calib.scales):
        block = build_q2_mamba2_block(_variant(x_groups="tensor"), bank.raw(i), s, d, i)
        assert torch.equal(block.q.x_scales, torch.full((d.d_inner,), s.s_x_tensor))
        x = tensor[f"L{i}.conv1d.x"].numpy()
        assert on_grid(x, s.s_x_tensor)
        assert not torch.equal(tensor[f"L{i}.conv1d.x"], grouped[f"L{i}.conv1d.x"])
    # layer 0's x codes are the grouped conv's (the oracle, kernels.conv1d_grouped) with every output scale s_x_tensor
    s = calib.scales[0]
    q = build_q2_mamba2_block(_variant(x_groups="tensor"), bank.raw(0), s, d, 0).q
    ch = s.reorder.channel_index.long()
    gs = d.ngroups * d.d_state
    xBC = tensor["L0.in_proj.xBC"]
    codes = torch.cat([(xBC[..., :d.d_inner] / s.s_x).round()[..., ch], (xBC[..., d.d_inner:d.d_inner + gs] / s.s_B).round(),
                       (xBC[..., d.d_inner + gs:] / s.s_C).round()], -1).to(torch.int8)
    w, ws, bc, bs = q.conv
    ref = q2_conv1d_ref(codes, (s.s_x, s.s_B, s.s_C), w, ws, bc, bs, q.conv_out, x_dim=d.d_inner)[..., :d.d_inner]
    assert torch.equal(tensor["L0.conv1d.x"][..., ch], ref.to(torch.float32) * s.s_x_tensor)
    # the observer, written out on the reordered fp16 calibration model's x (pass 2 of the same calibration)
    assert calib.scales[0].s_x_tensor == _percentile_written_out(bank, windows, calib)


def _percentile_written_out(bank, windows, calib, alpha: float = 0.9995) -> float:
    from harness.architectures.mamba2.build import build_mamba2_block
    from harness.emulation.modules import EmuBackbone
    from harness.recipes.quamba.q2.params import reorder_raw
    from harness.architectures.mamba2.weights import float_layer_mamba2
    from harness.modes import Q2_CALIBRATION_RECIPE

    d = bank.dims
    raw = reorder_raw(bank.raw(0), calib.scales[0].reorder, d.d_inner, d.nheads)
    m = EmuBackbone(lambda ids: bank.embed(ids, True, torch.float16, "exact", "fp16"),
                    [build_mamba2_block(Q2_CALIBRATION_RECIPE, float_layer_mamba2(raw, True, torch.float16), d, 0)])
    with capture(m, ["L0.conv1d.x"]) as cap:
        m(windows)
    x = cap["L0.conv1d.x"].values.to(torch.float16).to(torch.float32).abs().reshape(windows.shape[0], -1)
    ema = None
    for row in x:
        cur = torch.quantile(row, alpha)
        ema = cur if ema is None else ema + 0.01 * (cur - ema)
    return float((ema / 127).clamp(min=1e-6))


def test_ssm_impl_reference_is_ssd_ref_on_the_same_inputs(model):
    """ssm_impl (the existing knob) on q2-w8a8: reference is kernels.ssd.ssd_ref, kernel kernels.ssd.ssd_chunked, both on
    the SSD's dequantized inputs as the taps hold them; everything up to the SSD is bit-identical."""
    bank, windows, calib = model
    d = bank.dims
    ids = windows[:2]
    b, L = ids.shape
    runs = {impl: _taps(build_backbone(_variant(ssm_impl=impl), bank, calib.scales, 0), ids, (0,))
            for impl in ("kernel", "reference")}
    for p in BEFORE_CONV + ("conv1d.x", "conv1d.B", "conv1d.C", "ssd.dt"):
        assert torch.equal(runs["kernel"][f"L0.{p}"], runs["reference"][f"L0.{p}"]), p
    s = calib.scales[0]
    q = q2_params(bank.raw(0), s, d)
    ch, heads = s.reorder.channel_index.long(), s.reorder.head_index.long()
    t = runs["kernel"]
    x = t["L0.conv1d.x"][..., ch].reshape(b, L, d.nheads, d.headdim)
    dt = t["L0.ssd.dt"][..., heads]
    B = t["L0.conv1d.B"].reshape(b, L, d.ngroups, d.d_state)
    C = t["L0.conv1d.C"].reshape(b, L, d.ngroups, d.d_state)
    A_log = q.A_log.scale * q.A_log.codes.to(torch.float32)
    D = q.D.scale * q.D.codes.to(torch.float32)
    assert torch.equal(x, q.x_scales.reshape(d.nheads, d.headdim) * (x / q.x_scales.reshape(d.nheads, d.headdim)).round())
    for impl, fn in (("kernel", lambda: ssd_chunked(x, dt, A_log, B, C, D, d.chunk_size)),
                     ("reference", lambda: ssd_ref(x, dt, A_log, B, C, D))):
        y, state = fn()
        y16 = y.reshape(b, L, d.d_inner).to(torch.float16).to(torch.float32)
        assert torch.equal(runs[impl]["L0.ssd.y"][..., ch], y16), impl
        tap = runs[impl]["L0.ssd.state"]   # in the model's order: heads and the channels inside each head
        assert torch.equal(tap.reshape(b, d.d_inner, -1)[:, ch].reshape(state.shape), state), impl
    assert not torch.equal(runs["kernel"]["L0.ssd.state"], runs["reference"]["L0.ssd.state"])


def test_state_dtype_fp32_is_the_decode_state_only(model):
    """state_dtype sets the block's decode state; the prefill forward never reads the quantized state, so every
    tap and the output are bit-identical, and the stats record the knob only when changed."""
    bank, windows, calib = model
    ids = windows[:2]
    runs = {v: build_backbone(_variant(state_dtype=v), bank, calib.scales, 1) for v in ("int8", "fp32")}
    assert [b.state_dtype for b in runs["fp32"].blocks] == ["fp32", "fp32"]
    assert [b.state_dtype for b in runs["int8"].blocks] == ["int8", "int8"]
    a, b = _taps(runs["int8"], ids), _taps(runs["fp32"], ids)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _variant(state_dtype="fp32").knobs()["state_dtype"] == "fp32"


def test_knob_values_are_checked_and_mamba1_recipes_refuse_them():
    with pytest.raises(ModeError, match="x_groups='heads' is not valid; valid values: grouped, tensor"):
        _variant(x_groups="heads")
    with pytest.raises(ModeError, match="state_dtype='fp16' is not valid; valid values: int8, fp32"):
        _variant(state_dtype="fp16")
    for base in ("0", "2-4", "fp32"):
        with pytest.raises(ModeError, match=r"x_groups=tensor apply to Quamba2's W8A8 only \(prep=quamba2"):
            replace(get_mode(base), name="m", x_groups="tensor")
    with pytest.raises(ModeError, match=r"state_dtype=fp32 apply to Quamba2's W8A8 only"):
        replace(get_mode("0"), name="m", state_dtype="fp32")


def test_a_mode_file_sets_them_and_resume_reads_them_back(tmp_path):
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"modes": {"q2-tensor": {"base": "q2-w8a8", "x_groups": "tensor", "state_dtype": "fp32",
                                                     "ssm_impl": "reference"}}}))
    (r,) = load_modes_file(f)
    assert (r.x_groups, r.state_dtype, r.ssm_impl, r.prep) == ("tensor", "fp32", "reference", "quamba2")
    assert recorded_recipe("q2-tensor", {"recipe": json.loads(json.dumps(r.knobs())), "title": r.title}) == r
    f.write_text(json.dumps({"modes": {"m": {"base": "q2-w8a8", "x_groups": 1}}}))
    with pytest.raises(ModeError, match="knob values must be strings"):
        load_modes_file(f)


def test_a_mamba1_mode_file_asking_for_them_is_exit_2(tmp_path, capsys):
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"modes": {"t": {"base": "0", "x_groups": "tensor"}}}))
    code = run_cli(capture_main, ["--model", ROOT / "models" / "mamba-tiny", "--modes", "t", "--modes_file", f,
                                  "--seq_len", "16", "--output_file", tmp_path / "x.npz"])
    err = capsys.readouterr().err
    assert code == 2 and "x_groups=tensor apply to Quamba2's W8A8 only" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json"]


def test_x_groups_tensor_end_to_end_on_the_shipped_mamba2(tmp_path, capsys):
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"modes": {"q2-tensor": {"base": "q2-w8a8", "x_groups": "tensor"}}}))
    out = tmp_path / "t.npz"
    code = run_cli(capture_main, ["--model", TINY2, "--modes", "q2-w8a8", "q2-tensor", "--modes_file", f,
                                  "--layers", "0", "--taps", "conv1d.x", "conv1d.B", "--seq_len", "48",
                                  "--calib_data_num", "4", "--calib_seqlen", "64", "--no_cache", "--output_file", out])
    assert code == 0, capsys.readouterr().err
    cap = load_capture(out)
    assert cap.manifest["modes"]["q2-tensor"]["recipe"]["x_groups"] == "tensor"
    assert "x_groups" not in cap.manifest["modes"]["q2-w8a8"]["recipe"]
    layer = cap.manifest["provenance"]["calibration_by_prep"]["quamba2"]["layers"][0]
    assert on_grid(cap.array("q2-tensor", "L0.conv1d.x"), layer["s_x_tensor"])
    assert np.array_equal(cap.array("q2-tensor", "L0.conv1d.B"), cap.array("q2-w8a8", "L0.conv1d.B"))


def test_x_groups_tensor_on_a_quamba2_checkpoint_is_exit_2(tmp_path, capsys):
    """A Quamba2 checkpoint stores the grouped x table only: x_groups=tensor is refused before any work; the
    other knobs run from its codes."""
    from quamba2_fixture import write_handmade_q2

    ckpt = write_handmade_q2(tmp_path / "quamba2-tiny-w8a8")
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"modes": {"q2-xt": {"base": "q2-w8a8", "x_groups": "tensor"},
                                       "q2-seq": {"base": "q2-w8a8", "ssm_impl": "reference", "state_dtype": "fp32"}}}))
    out = tmp_path / "o.npz"
    code = run_cli(capture_main, ["--model", ckpt, "--modes", "q2-w8a8", "q2-xt", "--modes_file", f, "--seq_len", 12,
                                  "--output_file", out, "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and "q2-xt (x_groups=tensor) need the per-tensor x scale" in err and "Traceback" not in err
    assert not out.exists() and not out.with_name("o_stats.json").exists()
    code = run_cli(capture_main, ["--model", ckpt, "--modes", "q2-w8a8", "q2-seq", "--modes_file", f, "--seq_len", 12,
                                  "--layers", "0", "--output_file", out, "--quiet"])
    assert code == 0, capsys.readouterr().err
    assert load_capture(out).manifest["modes"]["q2-seq"]["recipe"]["ssm_impl"] == "reference"
