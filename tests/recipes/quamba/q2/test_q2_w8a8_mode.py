"""The q2-w8a8 mode (Quamba2 W8A8 of Mamba-2 blocks): its calibration against the observers written out by hand,
the block against a written-out reference of Quamba's arithmetic, the reorder, the recipe's architectures, and
the main job end to end on the shipped tiny Mamba-2."""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT
from harness.checkpoints.loading import open_checkpoint
from harness.cli import capture_main
from harness.runner.backbone import build_backbone
from harness.architectures.mamba2.build import build_mamba2_block
from harness.emulation.capture import MAMBA2_POINTS, capture
from harness.recipes.quamba.q2.grouping import group_wise_sort_indices
from harness.emulation.modules import EmuBackbone
from harness.kernels.hadamard import hadamard_transform
from harness.kernels.conv1d_grouped import q2_conv1d_ref
from harness.kernels.norms import q2_gated_norm_ref
from harness.kernels.linear import q2_in_proj_ref
from harness.recipes.quamba.q2.params import q2_params, reorder_raw
from harness.architectures.mamba2.weights import float_layer_mamba2
from harness.modes import Q2_CALIBRATION_RECIPE, ModeError
from harness.recipes.quamba.families import calibrate_key
from harness.recipes.registry import architectures_of, get_mode, resolve_modes
from harness.runner.calibration import CalibrationSettings
from harness.runner.layercache import LayerCache
from harness.runner.weightbank import WeightBank
from harness.spec import QTensor
from harness.store.reader import load_capture
from helpers import cache_entry, edit_cache_entry, on_grid, run_cli

from mamba2_fixtures import make_mamba2

def calibrate(bank, windows, settings, depth, prefix_hashes, cache_dir, key="quamba", **kw):
    """The calibration of any Quamba key (recipes.quamba.families.calibrate_key), in the order of old."""
    return calibrate_key(bank, windows, settings, depth, prefix_hashes, cache_dir, key, **kw)


SEQ = 21  # chunk_size 8: two chunk boundaries inside the sample
SETTINGS = CalibrationSettings(num_samples=6, seqlen=SEQ, batch_size=4)
TINY2 = ROOT / "models" / "mamba2-tiny"


@pytest.fixture(scope="module", params=[1, 2], ids=["ngroups1", "ngroups2"])
def model(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"q2g{request.param}")
    make_mamba2(out, ngroups=request.param, layers=2, seed=10 + request.param, headdim=4)
    bank = WeightBank(open_checkpoint(out))
    gen = torch.Generator().manual_seed(request.param)
    windows = torch.randint(0, 64, (SETTINGS.num_samples, SEQ), generator=gen)
    calib = calibrate(bank, windows, SETTINGS, 1, [], None, "quamba2")
    return bank, windows, calib


def _embed(bank):
    return lambda ids: bank.embed(ids, True, torch.float16, "exact", "fp16")


def _capture_all(backbone, layers, ids):
    names = [f"L{i}.{p}" for i in layers for p in MAMBA2_POINTS]
    with capture(backbone, names) as cap:
        backbone(ids)
    return {k: v.values for k, v in cap.items()}


def test_calibration_is_quamba2_s_observers_written_out(model):
    """Pass 1: per sample mean |x| over tokens, max over samples -> grouping; pass 2 on the reordered fp16 model:
    min-max (fp16 amax / 127 in fp16), x's max per (SSD group, head group, dim group) / 127 in fp32, B and C per
    SSD group in fp16 (quamba/observer.py:16-31, 121-170, 173-258)."""
    bank, windows, calib = model
    d = bank.dims
    raws = [bank.raw(i) for i in range(2)]
    plain = EmuBackbone(_embed(bank), [build_mamba2_block(Q2_CALIBRATION_RECIPE, float_layer_mamba2(r, True, torch.float16),
                                                          d, i) for i, r in enumerate(raws)])
    cap = _capture_all(plain, [0, 1], windows)
    for i in range(2):
        x = cap[f"L{i}.conv1d.x"].double()
        stats = (x.abs().mean(dim=1)).to(torch.float16).to(torch.float32).amax(dim=0)
        expect = group_wise_sort_indices(stats, d.headdim, d.ngroups)
        got = calib.scales[i].reorder
        assert torch.equal(got.channel_index, expect.channel_index) and torch.equal(got.head_index, expect.head_index)
        assert sorted(got.channel_index.tolist()) == list(range(d.d_inner))
        assert (got.head_groups.sum(-1) == d.nheads // d.ngroups).all() and (got.dim_groups.sum(-1) == d.headdim).all()
    reordered = [reorder_raw(r, s.reorder, d.d_inner, d.nheads) for r, s in zip(raws, calib.scales)]
    model2 = EmuBackbone(_embed(bank), [build_mamba2_block(Q2_CALIBRATION_RECIPE, float_layer_mamba2(r, True, torch.float16),
                                                           d, i) for i, r in enumerate(reordered)])
    cap = _capture_all(model2, [0, 1], windows)
    f16 = lambda t: float((t.to(torch.float16).abs().amax().clamp(min=1e-5) / 127).float().clamp(min=1e-6))  # noqa: E731
    gs = d.ngroups * d.d_state
    for i, s in enumerate(calib.scales):
        xBC = cap[f"L{i}.in_proj.xBC"]
        assert s.s_in == f16(cap[f"L{i}.norm.out"]) and s.s_z == f16(cap[f"L{i}.in_proj.z"])
        assert s.s_dt == f16(cap[f"L{i}.in_proj.dt"]) and s.s_H == f16(cap[f"L{i}.had.out"])
        assert (s.s_x, s.s_B, s.s_C) == (f16(xBC[..., :d.d_inner]), f16(xBC[..., d.d_inner:d.d_inner + gs]),
                                         f16(xBC[..., d.d_inner + gs:]))
        x = cap[f"L{i}.conv1d.x"].reshape(SETTINGS.num_samples, SEQ, d.ngroups, -1, d.headdim)
        for g in range(d.ngroups):
            h0 = 0
            for hg, hs in enumerate(s.reorder.head_groups[g].tolist()):
                c0 = 0
                for dg, cs in enumerate(s.reorder.dim_groups[g, hg].tolist()):
                    amax = x[:, :, g, h0:h0 + hs, c0:c0 + cs].abs().amax().clamp(min=1e-5)
                    assert float(s.x_table[g, hg, dg]) == float((amax / 127).clamp(min=1e-6))
                    c0 += cs
                h0 += hs
            for name, table in (("B", s.B_scales), ("C", s.C_scales)):
                part = cap[f"L{i}.conv1d.{name}"][..., g * d.d_state:(g + 1) * d.d_state].to(torch.float16)
                assert float(table[g]) == float((part.abs().amax().clamp(min=1e-5) / 127).float().clamp(min=1e-6))
        # ssm_state_scale: the final state in the fp16 cache, per (group, head group, dim group) and n
        # (CachedStatesCrossHeadMinmaxObserver, quamba/observer.py:288-384)
        state = cap[f"L{i}.ssd.state"].to(torch.float16).float().reshape(SETTINGS.num_samples, d.ngroups, -1,
                                                                         d.headdim, d.d_state)
        assert s.ssm_state_scale.shape == (d.ngroups, 4, 4, d.d_state)
        for g in range(d.ngroups):
            h0 = 0
            for hg, hs in enumerate(s.reorder.head_groups[g].tolist()):
                c0 = 0
                for dg, cs in enumerate(s.reorder.dim_groups[g, hg].tolist()):
                    amax = state[:, g, h0:h0 + hs, c0:c0 + cs].abs().amax(dim=(0, 1, 2)).clamp(min=1e-5)
                    assert torch.equal(s.ssm_state_scale[g, hg, dg], (amax / 127).clamp(min=1e-6))
                    c0 += cs
                h0 += hs


def test_reorder_keeps_the_float_model(model):
    """Permuting channels and heads (and out_proj's columns before the rotation) computes the same model."""
    bank, windows, calib = model
    d = bank.dims
    fp32 = get_mode("fp32")
    outs = []
    for raws in ([bank.raw(i) for i in range(2)],
                 [reorder_raw(bank.raw(i), calib.scales[i].reorder, d.d_inner, d.nheads) for i in range(2)]):
        bb = EmuBackbone(lambda ids: bank.embed(ids, True, torch.float32, "exact", "fp32"),
                         [build_mamba2_block(fp32, float_layer_mamba2(r, True, torch.float32), d, i)
                          for i, r in enumerate(raws)])
        outs.append(bb(windows[:2]))
    assert float((outs[0] - outs[1]).norm() / outs[0].norm()) < 1e-6


def _codes(values: torch.Tensor, scale) -> torch.Tensor:
    codes = torch.round(values.double() / torch.as_tensor(scale).double())
    assert torch.equal((codes.float() * torch.as_tensor(scale, dtype=torch.float32)), values), "off the int8 grid"
    assert codes.abs().max() <= 128
    return codes.to(torch.int8)


def _ssd_float64(x, dt, A, B, C, D):
    """The SSD recurrence in float64: h_t = exp(dt A) h_{t-1} + dt x B; y = C h + D x."""
    b, L, h, p = x.shape
    rep = h // B.shape[2]
    Bh, Ch = B.repeat_interleave(rep, 2), C.repeat_interleave(rep, 2)
    state = torch.zeros(b, h, p, B.shape[-1], dtype=torch.float64)
    ys = []
    for t in range(L):
        decay = torch.exp(dt[:, t] * A)[:, :, None, None]
        state = decay * state + (dt[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None, :]
        ys.append((state * Ch[:, t, :, None, :]).sum(-1) + D[None, :, None] * x[:, t])
    return torch.stack(ys, 1)


def test_block_against_written_out_reference(model):
    """Every stage of the block from its own input, by the oracles of kernels.conv1d_grouped and float64 written out:
    in_proj and conv codes exact, the SSD's y within fp16 rounding, gated norm and out_proj within an fp16 ulp,
    the Hadamard's codes within one (the kernel's fp32 butterflies)."""
    bank, windows, calib = model
    d = bank.dims
    s = calib.scales[0]
    q = q2_params(bank.raw(0), s, d)
    bb = build_backbone(get_mode("q2-w8a8"), bank, calib.scales, 0)
    ids = windows[:2]
    cap = _capture_all(bb, [0], ids)
    ch, heads = s.reorder.channel_index.long(), s.reorder.head_index.long()
    gs = d.ngroups * d.d_state
    # RMSNorm to int8 at s_in, RNE, from the block's input (the fp16-rotated embedding)
    r = cap["L0.block.in"].double()
    normed = r / torch.sqrt((r * r).mean(-1, keepdim=True) + d.norm_eps)
    n_codes = _codes(cap["L0.norm.out"], s.s_in)
    assert (torch.round(normed / s.s_in).clamp(-128, 127) - n_codes.double()).abs().max() <= 1
    # in_proj: exact int8 codes, every split on its grid, in the reordered channel order
    proj = q2_in_proj_ref(QTensor(n_codes, s.s_in), q.in_proj, q.in_proj_b)
    z, xBC, dt = proj.split([d.d_inner, d.conv_dim, d.nheads], -1)
    assert torch.equal(_codes(cap["L0.in_proj.z"], s.s_z)[..., ch], z)
    assert torch.equal(_codes(cap["L0.in_proj.dt"], s.s_dt)[..., heads], dt)
    x_in = cap["L0.in_proj.xBC"]
    assert torch.equal(_codes(x_in[..., :d.d_inner], s.s_x)[..., ch], xBC[..., :d.d_inner])
    assert torch.equal(_codes(x_in[..., d.d_inner:d.d_inner + gs], s.s_B), xBC[..., d.d_inner:d.d_inner + gs])
    assert torch.equal(_codes(x_in[..., d.d_inner + gs:], s.s_C), xBC[..., d.d_inner + gs:])
    # grouped conv: exact codes at the per-group output scales
    w, ws, bcodes, bs = q.conv
    conv = q2_conv1d_ref(xBC, (s.s_x, s.s_B, s.s_C), w, ws, bcodes, bs, q.conv_out, x_dim=d.d_inner)
    qx, qB, qC = conv.split([d.d_inner, gs, gs], -1)
    assert torch.equal(_codes(cap["L0.conv1d.x"], q.x_scales[torch.argsort(ch)]), qx[..., torch.argsort(ch)])
    assert torch.equal(_codes(cap["L0.conv1d.B"], s.B_scales.repeat_interleave(d.d_state)), qB)
    assert torch.equal(_codes(cap["L0.conv1d.C"], s.C_scales.repeat_interleave(d.d_state)), qC)
    # A_log int8 from Quamba's fp16 parameter, in fp16 arithmetic; D from its fp32 one (qChunkScan.py:105-121)
    a16 = bank.raw(0)["A_log"][heads].to(torch.float16)
    s_a = a16.abs().amax() / 127
    assert q.A_log.scale == float(s_a) and torch.equal(q.A_log.codes, torch.round(a16 / s_a).to(torch.int8))
    d32 = bank.raw(0)["D"][heads].float()
    s_d = d32.abs().amax() / 127
    assert q.D.scale == float(s_d) and torch.equal(q.D.codes, torch.round(d32 / s_d).to(torch.int8))
    # the SSD on the dequantized inputs (quamba/triton/quant_chunk_cumsum.py:56-67, quant_chunk_scan.py:152-154)
    b, L = ids.shape
    dtv = torch.nn.functional.softplus(float(np.float32(s.s_dt)) * dt.double()
                                       + q.fp16.dt_bias.to(torch.float16).double())
    A = -torch.exp(q.A_log.scale * q.A_log.codes.double())
    y = _ssd_float64((q.x_scales.double() * qx.double()).reshape(b, L, d.nheads, d.headdim), dtv, A,
                     (s.B_scales.double()[:, None] * qB.double().reshape(b, L, d.ngroups, d.d_state)),
                     (s.C_scales.double()[:, None] * qC.double().reshape(b, L, d.ngroups, d.d_state)),
                     q.D.scale * q.D.codes.double()).reshape(b, L, d.d_inner)
    y_block = cap["L0.ssd.y"][..., ch]
    assert torch.equal(y_block, y_block.to(torch.float16).float())  # fp16 values
    assert float((y_block.double() - y).norm() / y.norm()) < 2e-3
    assert torch.allclose(cap["L0.ssd.dt"][..., heads].double(), dtv, rtol=1e-6, atol=1e-7)
    # gated norm from the block's own y: within an fp16 ulp of the float64 oracle
    g_ref = q2_gated_norm_ref(y_block, z, s.s_z, q.fp16.gnorm_weight, d.ngroups, 1e-5)  # qMamba2.py:1152
    g = cap["L0.gnorm.out"][..., ch]
    assert ((g - g_ref).abs() <= g_ref.abs() * 2.0 ** -10 + 2.0 ** -24).all()
    # online Hadamard to int8 at s_H, roundf (half away), in the reordered basis
    t = hadamard_transform(g.double()) / float(np.float32(s.s_H))
    h_ref = (torch.sign(t) * torch.floor(t.abs() + 0.5)).clamp(-128, 127)
    h = _codes(cap["L0.had.out"], s.s_H)
    diff = (h.double() - h_ref).abs()
    assert diff.max() <= 1 and float((diff == 0).double().mean()) > 0.99
    # W8A8B16O16 out_proj: int32 accumulation, times s_w * s_H, fp16 out
    acc = h.double() @ q.out_proj.codes.double().T
    out_ref = (acc * q.out_proj.scale * float(np.float32(s.s_H))).to(torch.float16).double()
    out = cap["L0.out_proj.out"].double()
    assert ((out - out_ref).abs() <= out_ref.abs() * 2.0 ** -10 + 2.0 ** -24).all()
    assert torch.equal(cap["L0.block.residual"], cap["L0.block.in"] + cap["L0.out_proj.out"])


def test_chunked_and_sequential_ssd_variants_agree(model):
    bank, windows, calib = model
    outs = [build_backbone(replace(get_mode("q2-w8a8"), ssm_impl=impl), bank, calib.scales, 1)(windows[:2])
            for impl in ("kernel", "reference")]
    assert float((outs[0] - outs[1]).norm() / outs[0].norm()) < 1e-2


def test_the_recipe_states_its_architectures():
    q2 = get_mode("q2-w8a8")
    assert architectures_of(q2) == ("mamba2", "bamba", "nemotron_h")  # hybrids' Mamba-2 blocks (q2.hybrid)
    assert architectures_of(get_mode("0")) == ("mamba1", "falcon_mamba")
    assert architectures_of(get_mode("fp32")) == ("mamba1", "mamba2", "falcon_mamba", "bamba", "nemotron_h")
    with pytest.raises(ModeError, match=r"mode 'q2-w8a8' does not run on a mamba1 model.*run mode 0"):
        resolve_modes(["fp32", "q2-w8a8"])
    assert [r.name for r in resolve_modes(["quant_only"], architecture="mamba2")] == ["q2-w8a8", "q2-w4a8", "q2-w4a16"]
    assert [r.name for r in resolve_modes(["all"], architecture="mamba2")] == ["fp32", "1", "q2-w8a8", "q2-w4a8",
                                                                               "q2-w4a16"]
    with pytest.raises(ModeError, match="prep=quamba2 is Quamba2's W8A8 recipe"):
        replace(q2, name="x", act_dtype="fp32")
    assert [r.name for r in resolve_modes(["q2-w8a8"], architecture=None)] == ["q2-w8a8"]  # names only


def test_q2_w8a8_on_a_mamba1_model_is_exit_2(tmp_path, capsys):
    code = run_cli(capture_main, ["--model", ROOT / "models" / "mamba-tiny", "--modes", "q2-w8a8", "--seq_len", "16",
                                  "--output_file", tmp_path / "x.npz"])
    err = capsys.readouterr().err
    assert code == 2 and "does not run on a mamba1 model" in err and "run mode 0" in err
    assert not list(tmp_path.iterdir())


def test_end_to_end_on_the_shipped_mamba2(tmp_path, capsys):
    out = tmp_path / "q2.npz"
    code = run_cli(capture_main, ["--model", TINY2, "--modes", "fp32", "q2-w8a8", "--layers", "all", "--end-to-end",
                                  "--taps", "in_proj.z", "conv1d.B", "had.out", "ssd.y", "--seq_len", "96", "--samples", "2",
                                  "--calib_data_num", "8", "--calib_seqlen", "128", "--no_cache",
                                  "--output_file", out])
    assert code == 0, capsys.readouterr().err
    cap = load_capture(out)
    stats = cap.manifest
    kl = stats["end_to_end"]["q2-w8a8"]["kl"]["mean"]
    assert math.isfinite(kl) and 0 < kl < 0.05
    calib = stats["provenance"]["calibration_by_prep"]["quamba2"]
    assert calib["source"] == "computed" and "cache_files" not in calib and len(calib["layers"]) == 3
    for i, layer in enumerate(calib["layers"]):
        assert on_grid(cap.array("q2-w8a8", f"L{i}.in_proj.z"), layer["s_z"])
        assert on_grid(cap.array("q2-w8a8", f"L{i}.had.out"), layer["s_H"])
        B = cap.array("q2-w8a8", f"L{i}.conv1d.B")
        for g, scale in enumerate(layer["B_scales"]):
            assert on_grid(B[..., g * 16:(g + 1) * 16], np.float32(scale))
        y = cap.array("q2-w8a8", f"L{i}.ssd.y")
        assert np.array_equal(y, y.astype(np.float16).astype(np.float32))


def test_early_exit_equals_the_full_model(model):
    """Calibrating and building only block 0 gives block 0 the same scales, groups and taps as the whole model."""
    bank, windows, calib = model
    shallow = calibrate(WeightBank(open_checkpoint(bank.ckpt.path)), windows, SETTINGS, 0, [], None, "quamba2")
    assert shallow.info["layers"][0] == calib.info["layers"][0]
    ids = windows[:2]
    caps = [_capture_all(build_backbone(get_mode("q2-w8a8"), bank, scales, depth), [0], ids)
            for scales, depth in ((shallow.scales, 0), (calib.scales, 1))]
    assert caps[0].keys() == caps[1].keys() and all(torch.equal(caps[0][k], caps[1][k]) for k in caps[0])


def test_the_calibration_is_cached_and_a_bad_entry_is_recomputed(model, tmp_path, caplog):
    bank, windows, calib = model
    prefix = bank.ckpt.prefix_hashes(1)
    first = calibrate(bank, windows, SETTINGS, 1, prefix, tmp_path, "quamba2")
    assert first.info["source"] == "computed" and first.info["layers"] == calib.info["layers"]
    again = calibrate(bank, windows, SETTINGS, 1, prefix, tmp_path, "quamba2")
    assert again.info["source"] == "reused" and again.info["layers"] == calib.info["layers"]
    assert all(torch.equal(a.reorder.channel_index, b.reorder.channel_index) for a, b in zip(again.scales, calib.scales))
    other = calibrate(bank, windows[:4], SETTINGS, 1, prefix, tmp_path, "quamba2")  # other tokens: another key
    assert other.info["source"] == "computed"
    path = Path(first.info["cache_files"][1])
    header = cache_entry(path)
    assert (header["kind"], header["key"], header["payload"]["layer"]) == ("calib-q2", first.info["keys"][1], 1)
    assert set(header["arrays"]) == {"x_table", "B_scales", "C_scales", "ssm_state_scale", "channel_index",
                                     "head_index", "head_groups", "dim_groups"}
    edit_cache_entry(path, lambda p: p["scales"].update(s_z=-1.0))  # a bad scale under a valid checksum is refused too
    fixed = calibrate(bank, windows, SETTINGS, 1, prefix, tmp_path, "quamba2")
    assert fixed.info["source"] == "recomputed" and "s_z=-1.0" in fixed.info["reason"]
    assert fixed.info["layers"] == calib.info["layers"] and "recomputing" in caplog.text
    with np.load(path) as z:  # a scale table that does not fit the model, under a valid checksum
        arrays = {k: z[k] for k in z.files if k != "__entry__"}
    arrays["x_table"] = arrays["x_table"][..., :1]
    LayerCache(tmp_path, "calib-q2").write(first.info["keys"][1], cache_entry(path)["payload"], arrays)
    misfit = calibrate(bank, windows, SETTINGS, 1, prefix, tmp_path, "quamba2")
    assert misfit.info["source"] == "recomputed" and "the group tables do not fit the model" in misfit.info["reason"]
    path.write_bytes(path.read_bytes()[:50])
    truncated = calibrate(bank, windows, SETTINGS, 1, prefix, tmp_path, "quamba2")
    assert truncated.info["source"] == "recomputed" and "unreadable" in truncated.info["reason"]
    assert truncated.info["layers"] == calib.info["layers"]


def test_too_few_heads_per_ssd_group_is_a_clear_error(tmp_path):
    """Quamba2 makes 4 head groups per SSD group: 2 heads per group cannot be grouped."""
    make_mamba2(tmp_path, ngroups=2, layers=1, d_model=16, headdim=8)
    bank = WeightBank(open_checkpoint(tmp_path))
    with pytest.raises(ValueError, match="2 heads per SSD group and headdim 8"):
        calibrate(bank, torch.zeros(2, 8, dtype=torch.int64), SETTINGS, 0, [], None, "quamba2")


def test_decode_with_the_w4_modes_keeps_only_the_one_sample_refusal(tmp_path, capsys):
    """The W4 modes decode (tests/recipes/quamba/w4/test_decode_q2w4.py): with them --decode / --generate are refused only for what
    is refused of every mode (here --samples 2), before any work, and no longer for their step."""
    for flag in (["--decode", "2"], ["--generate", "2"]):
        code = run_cli(capture_main, ["--model", TINY2, "--modes", "all", "--seq_len", "16", "--samples", "2", *flag,
                                      "--output_file", tmp_path / "d.npz"])
        err = capsys.readouterr().err
        assert code == 2 and "--decode and --generate run one sample" in err and "Marlin" not in err, err
    assert not list(tmp_path.iterdir())


def test_int8_taps_are_recorded_as_int8_with_their_scale(tmp_path, capsys):
    """Issue "What trying it found" 11: q2-w8a8's int8 taps were stored with kind "float", quantized false and no
    scale, although every value is a code times one scale. They are now recorded as Mamba-1's int8 taps are
    (kind, scale, saturation); the arrays are the real values as before, integer multiples of that scale."""
    out = tmp_path / "q2.npz"
    code = run_cli(capture_main, ["--model", TINY2, "--modes", "fp32", "q2-w8a8", "--layers", "0", "--taps", "all",
                                  "--seq_len", "32", "--calib_data_num", "4", "--calib_seqlen", "32", "--no_cache",
                                  "--quiet", "--output_file", out])
    assert code == 0, capsys.readouterr().err
    cap = load_capture(out)
    layer = cap.manifest["provenance"]["calibration_by_prep"]["quamba2"]["layers"][0]
    tensors = cap.manifest["modes"]["q2-w8a8"]["tensors"]
    for point, key in (("norm.out", "s_in"), ("in_proj.z", "s_z"), ("in_proj.dt", "s_dt"), ("had.out", "s_H")):
        st = tensors[f"L0.{point}"]
        assert st["kind"] == "int8" and st["quantized"] is True, (point, st)
        assert np.float32(st["scale"]) == np.float32(layer[key]), point
        assert 0.0 <= st["saturated_fraction"] < 0.05 and "overflow_upper" not in st
        assert on_grid(cap.array("q2-w8a8", f"L0.{point}"), st["scale"]), point
    assert tensors["L0.gnorm.out"]["kind"] == "float" and "scale" not in tensors["L0.gnorm.out"]
    # the multi-scale taps (issue 35: they were recorded as float): int8, with the summary of a scale per channel
    d_inner = cap.array("q2-w8a8", "L0.conv1d.x").shape[-1]
    for point, channels in (("in_proj.xBC", cap.array("q2-w8a8", "L0.in_proj.xBC").shape[-1]), ("conv1d.x", d_inner)):
        st = tensors[f"L0.{point}"]
        assert st["kind"] == "int8" and st["quantized"] is True and "scale" not in st, (point, st)
        assert st["scales"]["per"] == "channel" and st["scales"]["channels"] == channels, point
        assert 0 < st["scales"]["min"] < st["scales"]["max"] and st["scales"]["distinct"] > 1, point
        assert 0.0 <= st["saturated_fraction"] < 0.05, point
    assert tensors["L0.in_proj.xBC"]["scales"]["distinct"] == 3  # s_x, s_B, s_C: in_proj's split output scales
    fp32 = cap.manifest["modes"]["fp32"]["tensors"]["L0.norm.out"]
    assert fp32["kind"] == "float" and fp32["quantized"] is False


def test_conv_B_and_C_are_int8_taps_when_the_ssd_groups_share_one_scale(model):
    """conv1d.B and conv1d.C carry one scale per SSD group: one group, one scale, an int8 tap (issue 11)."""
    bank, windows, calib = model
    s = calib.scales[0]
    bb = build_backbone(get_mode("q2-w8a8"), bank, calib.scales, 0)
    with capture(bb, ["L0.conv1d.B", "L0.conv1d.C", "L0.conv1d.x", "L0.norm.out"]) as cap:
        bb(windows[:2])
    assert cap["L0.norm.out"].quantized and cap["L0.norm.out"].scale == s.s_in
    x = cap["L0.conv1d.x"]                                            # a scale per channel (its head/dim group)
    assert x.quantized and x.scale["per"] == "channel" and x.scale["channels"] == x.values.shape[-1]
    block = bb.blocks[0]
    assert torch.equal(x.values, x.codes.float() * block._ch(block.q.x_scales))
    for point, scales in (("conv1d.B", s.B_scales), ("conv1d.C", s.C_scales)):
        c = cap[f"L0.{point}"]
        if bank.dims.ngroups == 1:
            assert c.quantized and c.scale == float(scales[0])
            assert torch.equal(c.codes.float() * torch.tensor(c.scale, dtype=torch.float32), c.values)
        else:
            assert len(set(scales.tolist())) > 1 and c.quantized and c.scale["distinct"] == len(set(scales.tolist()))
