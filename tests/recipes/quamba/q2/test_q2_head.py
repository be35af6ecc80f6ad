"""Quamba2's quantized embedding and lm_head as recipe knobs (docs/modes.md "Embedding and lm_head"): each value
against a written-out reference of its class's arithmetic, the default unchanged, the knobs end to end on the
shipped Mamba-2, and a Mamba-1 recipe asking for them is exit 2."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import ROOT
from harness.checkpoints.loading import open_checkpoint
from harness.cli import capture_main
from harness.runner.backbone import build_backbone
from harness.kernels.embedding_head import quantize_rows_int4_fp16, quantized_rows
from harness.kernels.quant import quantize_rows_signed_max_fp16
from harness.modes import ModeError, load_modes_file
from harness.recipes.registry import get_mode
from harness.runner.calibration import CalibrationSettings
from harness.recipes.quamba.families import calibrate_key
from harness.runner.forwards import build_head
from harness.runner.resume import recorded_recipe
from harness.runner.weightbank import WeightBank
from harness.store.reader import load_capture
from helpers import run_cli

TINY2 = ROOT / "models" / "mamba2-tiny"


def test_int8_row_by_hand():
    """W8O16Embedding (qEmbedding.py:81-91): s = f16(max(row) / 127) (the signed max: -2 saturates at -128);
    q = RNE(f16(e / s)); the lookup returns f16(s * q)."""
    row = torch.tensor([[1.0, -0.5, 0.25, -2.0, 0.0]])
    codes, scales = quantize_rows_signed_max_fp16(row)
    s = np.float16(np.float16(1.0) / np.float16(127))  # 1032 * 2**-17
    assert float(scales[0]) == float(s) == 1032 * 2.0 ** -17
    # e / s in fp16: 127.0078 -> 127.0; -63.5039 -> -63.5 -> -64 (half to even); 31.752 -> 31.75 -> 32; -254 -> -128
    assert codes[0].tolist() == [127, -64, 32, -128, 0]
    out = quantized_rows(row, "int8")
    assert out[0].tolist() == [float(np.float16(np.float32(c) * np.float32(s))) for c in (127, -64, 32, -128, 0)]


def test_int4_row_by_hand():
    """W4O16Embedding (qEmbedding.py:26-47): s = f16(max(row) / 8), q = clamp(round(f16(f16(e / s) + 8)), 0, 15);
    the lookup returns f16(s * (q - 8))."""
    row = torch.tensor([[2.0, -1.0, 0.3, -2.5, 0.125, 0.0, 1.9375, 0.1875]])
    codes, scales = quantize_rows_int4_fp16(row)
    assert float(scales[0]) == 0.25
    # e / s + 8 = 16, 4, 9.2, -2, 8.5 (-> 8, half to even), 8, 15.75, 8.75 -> clamp to 0..15
    assert codes[0].tolist() == [15, 4, 9, 0, 8, 8, 15, 9]
    assert quantized_rows(row, "int4")[0].tolist() == [1.75, -1.0, 0.25, -2.0, 0.0, 0.0, 1.75, 0.25]


@pytest.fixture(scope="module")
def bank():
    return WeightBank(open_checkpoint(TINY2))


@pytest.fixture(scope="module")
def scales(bank):
    windows = torch.randint(0, bank.dims.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    return calibrate_key(bank, windows, CalibrationSettings(num_samples=2, seqlen=16,
                         batch_size=2), 0, bank.ckpt.prefix_hashes(0), None, "quamba2").scales


def test_embedding_knob_quantizes_the_rows_of_the_mode(bank, scales):
    ids = torch.tensor([[0, 5, 17, 5]])
    base = get_mode("q2-w8a8")
    plain = build_backbone(base, bank, scales, 0).embed(ids)
    for kind in ("int8", "int4"):
        got = build_backbone(replace(base, name="e", embedding=kind), bank, scales, 0).embed(ids)
        assert torch.equal(got, quantized_rows(plain, kind)) and not torch.equal(got, plain)
    # the default: the rows of the mode's embedding, untouched (what build_backbone returned before the knob)
    assert torch.equal(plain, bank.embed(ids, True, torch.float16, base.prep, base.weights))


def test_lm_head_quantized_against_its_arithmetic(bank):
    """W8A8B16O16Linear.from_fp16 (qLinearLayer.py:771-785) behind QRMSNorm: codes of the fp16 head at
    s_w = f16(max|w| / 127), alpha = f32(s_w) * s_in, logits f16(alpha * (x_codes @ w_codes))."""
    base, s_in = get_mode("q2-w8a8"), 0.03
    head = build_head(replace(base, name="h", lm_head="quantized"), bank, s_in)
    w16 = build_head(base, bank).weight.numpy().astype(np.float16)
    s_w = np.float16(np.abs(w16).max() / np.float16(127))
    codes = np.clip(np.round(w16 / s_w), -128, 127)  # fp16 division, half to even
    assert np.array_equal(head.weight.codes.numpy(), codes) and head.weight.scale == float(s_w)
    residual = torch.randn(1, 5, bank.dims.d_model, generator=torch.Generator().manual_seed(3))
    x = head.norm(residual)  # QRMSNorm at s_in: int8 codes
    assert x.scale == s_in
    acc = x.codes.numpy().astype(np.int64) @ codes.T.astype(np.int64)
    alpha = np.float32(np.float32(s_w) * np.float32(s_in))
    want = (alpha * acc.astype(np.float32)).astype(np.float16).astype(np.float32)
    assert np.array_equal(head(residual).numpy(), want)
    with pytest.raises(ValueError, match="lm_head:input scale"):
        build_head(replace(base, name="h", lm_head="quantized"), bank)


def test_defaults_leave_the_built_in_modes_as_they_were():
    for name in ("q2-w8a8", "q2-w4a8", "q2-w4a16", "0", "fp32"):
        r = get_mode(name)
        assert r.embedding == "fp16" and r.lm_head == "fp16"
        assert "embedding" not in r.knobs() and "lm_head" not in r.knobs()  # the stored recipes unchanged


def test_mode_file_values_validation_and_resume(tmp_path):
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"modes": {"q2-eval": {"base": "q2-w8a8", "embedding": "int8", "lm_head": "quantized"}}}))
    (r,) = load_modes_file(f)
    assert r.knobs()["embedding"] == "int8" and r.knobs()["lm_head"] == "quantized"
    assert recorded_recipe("q2-eval", {"recipe": {k: str(v) for k, v in r.knobs().items()}}) == replace(r, title="")
    with pytest.raises(ModeError, match="embedding='int2' is not valid; valid values: fp16, int8, int4"):
        replace(r, embedding="int2")
    # the W4 recipes' heads (W4A8B16O16Linear, W4A16B16O16Linear: tests/recipes/quamba/w4/test_w4_lm_head.py)
    assert replace(get_mode("q2-w4a8"), name="w", lm_head="quantized").knobs()["lm_head"] == "quantized"
    with pytest.raises(ModeError, match="lm_head=quantized are Quamba2's quantized embedding/lm_head"):
        replace(get_mode("q2-w4a16"), name="w", prep="quamba", lm_head="quantized")  # a W4 recipe on Mamba-1
    assert replace(get_mode("q2-w4a16"), name="w", embedding="int4").embedding == "int4"


def test_a_mamba1_mode_file_asking_for_them_is_exit_2(tmp_path, capsys):
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"modes": {"t": {"base": "0", "lm_head": "quantized"}}}))
    code = run_cli(capture_main, ["--model", ROOT / "models" / "mamba-tiny", "--modes", "t", "--modes_file", f,
                                  "--seq_len", "16", "--output_file", tmp_path / "x.npz"])
    err = capsys.readouterr().err
    assert code == 2 and "lm_head=quantized are Quamba2's quantized embedding/lm_head" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json"]


def test_eval_recipe_end_to_end_on_the_shipped_mamba2(tmp_path, capsys):
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"modes": {"q2-eval": {"base": "q2-w8a8", "embedding": "int8", "lm_head": "quantized"}}}))
    args = ["--model", TINY2, "--modes", "fp32", "q2-w8a8", "q2-eval", "--modes_file", f, "--layers", "all",
            "--end-to-end", "--seq_len", "48", "--calib_data_num", "4", "--calib_seqlen", "64",
            "--cache_dir", tmp_path / "cache", "--stats_only"]
    assert run_cli(capture_main, [*args, "--output_file", tmp_path / "a.npz"]) == 0, capsys.readouterr().err
    stats = load_capture(tmp_path / "a.npz").manifest
    kl = {m: stats["end_to_end"][m]["kl"] for m in ("q2-w8a8", "q2-eval")}  # one sample: a number
    # measured 0.00138 and 0.00360: the int8 embedding and the int8 lm_head add to q2-w8a8's error
    assert math.isfinite(kl["q2-eval"]) and kl["q2-eval"] > kl["q2-w8a8"] > 0
    calib = stats["provenance"]["calibration_by_prep"]["quamba2"]
    assert calib["lm_head_input_scale_source"] == "computed" and calib["lm_head_input_scale"] > 0
    assert stats["modes"]["q2-eval"]["recipe"]["lm_head"] == "quantized"
    assert "lm_head" not in stats["modes"]["q2-w8a8"]["recipe"]
    # the second run reads the cached scale, and gives the same numbers
    assert run_cli(capture_main, [*args, "--output_file", tmp_path / "b.npz"]) == 0, capsys.readouterr().err
    again = load_capture(tmp_path / "b.npz").manifest
    calib2 = again["provenance"]["calibration_by_prep"]["quamba2"]
    assert calib2["lm_head_input_scale_source"] == "reused"
    assert calib2["lm_head_input_scale"] == calib["lm_head_input_scale"]
    assert again["end_to_end"]["q2-eval"]["kl"] == kl["q2-eval"]
    # a truncated entry is reported and recomputed (it had no checksum, and a bad entry was silently recomputed)
    (entry,) = (tmp_path / "cache").glob("calib-q2-head-*.npz")
    entry.write_bytes(entry.read_bytes()[:-20])
    capsys.readouterr()
    assert run_cli(capture_main, [*args, "--output_file", tmp_path / "c.npz"]) == 0
    assert "lm_head's input scale cache file" in capsys.readouterr().err
    calib3 = load_capture(tmp_path / "c.npz").manifest["provenance"]["calibration_by_prep"]["quamba2"]
    assert calib3["lm_head_input_scale_source"] == "recomputed" and "unreadable" in calib3["lm_head_input_scale_reason"]
    assert calib3["lm_head_input_scale"] == calib["lm_head_input_scale"] and calib3["source"] == "reused"


def test_the_lm_head_scale_entry_is_checked(tmp_path):
    """An lm_head input scale entry that is not a finite positive number, or under another key, is not used."""
    from harness.recipes.quamba.q2.head_scale import CACHE_KIND, _read
    from harness.runner.layercache import LayerCache
    cache = LayerCache(tmp_path, CACHE_KIND)
    assert _read(cache, "k") == (None, "") and _read(LayerCache(None, CACHE_KIND), "k") == (None, "")
    cache.write("k", {"lm_head_input_scale": 0.125})
    assert _read(cache, "k") == (0.125, "")
    for bad in (-1.0, float("nan"), float("inf"), 0.0, 1, "0.5", None):
        cache.write("k", {"lm_head_input_scale": bad})
        scale, problem = _read(cache, "k")
        assert scale is None and f"{cache.path('k')} is corrupted: the scale {bad!r} is not a finite positive" in problem
    cache.path("k").rename(cache.path("other"))
    assert _read(cache, "other") == (None, f"lm_head's input scale cache file {cache.path('other')} is corrupted: "
                                           "key mismatch")


def test_eval_recipe_matches_the_export_with_both_flags(tmp_path, capsys):
    """q2-eval on the float model computes what Quamba's checkpoint exported with --quantize_embedding
    --quantize_lm_head computes as q2-w8a8 (its stored int8 rows and W8A8B16O16Linear head): the logits bit for bit."""
    from harness.cli import export_main

    calib = ["--calib_data_num", "4", "--calib_seqlen", "64", "--cache_dir", tmp_path / "cache"]
    code = run_cli(export_main, ["--model", TINY2, "--output_dir", tmp_path / "ck", "--recipe", "w8a8",
                                 "--quantize_embedding", "--quantize_lm_head", *calib])
    assert code == 0, capsys.readouterr().err
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"modes": {"q2-eval": {"base": "q2-w8a8", "embedding": "int8", "lm_head": "quantized"}}}))
    common = ["--layers", "all", "--end-to-end", "--seq_len", "40", "--reference", "q2-w8a8", *calib]
    assert run_cli(capture_main, ["--model", TINY2, "--modes", "q2-w8a8", "q2-eval", "--modes_file", f, *common,
                                  "--output_file", tmp_path / "f.npz"]) == 0, capsys.readouterr().err
    assert run_cli(capture_main, ["--model", tmp_path / "ck", "--modes", "q2-w8a8", *common,
                                  "--output_file", tmp_path / "c.npz"]) == 0, capsys.readouterr().err
    ours, theirs = np.load(tmp_path / "f.npz"), np.load(tmp_path / "c.npz")
    assert np.array_equal(ours["mode_q2-eval__logits"], theirs["mode_q2-w8a8__logits"])
    assert not np.array_equal(ours["mode_q2-eval__logits"], ours["mode_q2-w8a8__logits"])


@pytest.mark.parametrize("extra", [["--generate", "3"], ["--decode", "3", "--end-to-end"]])
def test_a_quantized_lm_head_decodes_and_generates(tmp_path, capsys, extra):
    """--decode and --generate build the mode's head with its lm_head:input scale (they built it without, and the
    mode failed: "lm_head=quantized needs the lm_head:input scale")."""
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"modes": {"q2-eval": {"base": "q2-w8a8", "lm_head": "quantized"}}}))
    args = ["--model", TINY2, "--modes", "fp32", "q2-eval", "--modes_file", f, "--seq_len", "24",
            "--calib_data_num", "2", "--calib_seqlen", "64", "--cache_dir", tmp_path / "cache", *extra,
            "--output_file", tmp_path / "a.npz"]
    assert run_cli(capture_main, args) == 0, capsys.readouterr().err
    stats = load_capture(tmp_path / "a.npz").manifest
    assert stats["failed_modes"] == [] and stats["modes"]["q2-eval"]["status"] == "ok"
    assert stats["provenance"]["calibration_by_prep"]["quamba2"]["lm_head_input_scale"] > 0
