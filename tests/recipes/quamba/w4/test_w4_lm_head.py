"""lm_head=quantized of Quamba2's W4 recipes (docs/modes.md "Embedding and lm_head"): quantize_fp16_model's
W4A16B16O16Linear / W4A8B16O16Linear head (enyac-group/Quamba c474646 quamba/modelutils_mamba.py:650-657) from
Marlin's / Marlin-QQQ's round to nearest of the mode's rotated fp16 head (qLinearLayer.py:42-76, 172-217;
marlin_utils.py:139-192, 304-346), written out here in numpy; the W4A8 one behind QRMSNorm at the lm_head:input scale
q2-w8a8 observes; q2-w4ax with upstream's hard-coded W4A8 head (:740-743); the knob end to end on the shipped
Mamba-2, with --decode and --generate; the architectures it does not run on are exit 2."""
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
from harness.kernels.int4 import Int4Weight
from harness.kernels.w4_linear import w4a8_linear_ref, w4a16_linear_ref
from harness.recipes.registry import get_mode
from harness.runner.head import build_head
from harness.runner.weightbank import WeightBank
from harness.spec import QTensor
from harness.store.reader import load_capture
from helpers import run_cli

TINY2 = ROOT / "models" / "mamba2-tiny"
S_IN = 0.03  # an lm_head:input scale for the unit tests (the runs observe theirs)


@pytest.fixture(scope="module")
def bank():
    return WeightBank(open_checkpoint(TINY2))


def _rtn_by_hand(w: np.ndarray, channel: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """get_w4a16_quantize_weights / get_w4a8_quantize_weights (marlin_utils.py:139-192, 304-346) on one row at a
    time, numpy fp16: s = f16(f32(max|w_g|) * f32(2/15)), code = clamp(rint(f16(w / s)) + 8, 0, 15); Marlin-QQQ adds
    s_ch = f16(max|f16((code - 8) * s)|) / 127 in fp16, held in fp32, and the fused f16(f32(s) / s_ch)."""
    rows, cols = w.shape
    g = 128 if cols % 128 == 0 else cols  # kernels.int4.rtn_group_size: mamba2-tiny's d_model 192 is one group
    w16 = w.astype(np.float16).reshape(rows, cols // g, g)
    s = np.abs(w16).max(axis=2, keepdims=True)
    s = (s.astype(np.float32) * np.float32(2 / 15)).astype(np.float16)  # torch's fp16 `*=` computes in fp32
    q = np.rint((w16 / s).astype(np.float16))
    codes = np.clip(np.nan_to_num(q, nan=-8.0) + 8, 0, 15).astype(np.uint8)
    if not channel:
        return codes.reshape(rows, cols), s[:, :, 0], None
    w_ref = ((codes.astype(np.float16) - np.float16(8)) * s).astype(np.float16)
    s_ch = (np.abs(w_ref).max(axis=(1, 2)) / np.float16(127)).astype(np.float16).astype(np.float32)
    fused = np.nan_to_num((s[:, :, 0].astype(np.float32) / s_ch[:, None]).astype(np.float16), nan=0.0)
    return codes.reshape(rows, cols), fused, s_ch


@pytest.mark.parametrize("mode, channel", [("q2-w4a8", True), ("q2-w4a16", False)])
def test_the_head_is_the_marlin_rtn_of_the_rotated_fp16_head(bank, mode, channel):
    base = get_mode(mode)
    fp16 = build_head(base, bank).weight  # the mode's own rotated fp16 head (norm_f folded in)
    head = build_head(replace(base, name="h", lm_head="quantized"), bank, S_IN)
    w = head.weight
    assert isinstance(w, Int4Weight) and w.shape == tuple(fp16.shape) == (bank.dims.vocab_size, bank.dims.d_model)
    codes, scales, s_ch = _rtn_by_hand(fp16.numpy(), channel)
    assert np.array_equal(w.codes.numpy(), codes)
    assert np.array_equal(w.group_scales.numpy(), scales) and w.group_scales.dtype == torch.float16
    assert (w.channel_scales is None) if not channel else np.array_equal(w.channel_scales.numpy(), s_ch)
    # at most 16 levels per group, every one used somewhere; the values differ from the fp16 head's
    g = w.codes.reshape(w.shape[0], -1, w.group_size).to(torch.int64)
    levels = torch.zeros(*g.shape[:2], 16, dtype=torch.int64).scatter_add_(2, g, torch.ones_like(g))
    assert int((levels > 0).sum(dim=2).max()) <= 16 and bool((levels.sum(dim=(0, 1)) > 0).all())
    values = (w.codes.to(torch.float32) - 8) * w.group_scales.to(torch.float32).repeat_interleave(w.group_size, 1)
    if channel:
        values = values * w.channel_scales[:, None]
    err = (values - fp16).abs()
    assert 0 < float(err.max()) and bool((err <= 1.01 * values.abs().amax(dim=1, keepdim=True) / 7).all())


def test_the_w4a8_head_is_qrmsnorm_at_the_input_scale_and_the_marlin_qqq_gemm(bank):
    head = build_head(replace(get_mode("q2-w4a8"), name="h", lm_head="quantized"), bank, S_IN)
    residual = torch.randn(1, 3, bank.dims.d_model, generator=torch.Generator().manual_seed(3))
    x = head.norm(residual)
    assert isinstance(x, QTensor) and x.scale == S_IN  # QRMSNorm at lm_head:input (modelutils_mamba.py:654-655)
    rows = slice(0, 48)  # the oracle runs element by element: a slice of the vocabulary (rows are independent)
    part = Int4Weight(head.weight.codes[rows], head.weight.group_scales[rows], head.weight.channel_scales[rows],
                      head.weight.group_size)
    assert torch.equal(head(residual)[..., rows], w4a8_linear_ref(x, part, False))
    with pytest.raises(ValueError, match="lm_head:input scale"):
        build_head(replace(get_mode("q2-w4a8"), name="h", lm_head="quantized"), bank)


def test_the_w4a16_head_takes_the_fp16_norm_output(bank):
    base = get_mode("q2-w4a16")
    head = build_head(replace(base, name="h", lm_head="quantized"), bank)  # no input scale: none is needed
    residual = torch.randn(1, 3, bank.dims.d_model, generator=torch.Generator().manual_seed(4))
    x = head.norm(residual)
    assert torch.equal(x, build_head(base, bank).norm(residual))  # norm_f unchanged (modelutils_mamba.py:651)
    rows = slice(100, 140)
    part = Int4Weight(head.weight.codes[rows], head.weight.group_scales[rows], None, head.weight.group_size)
    assert torch.equal(head(residual)[..., rows], w4a16_linear_ref(x, part))


def _modes(tmp_path) -> object:
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"modes": {
        "w4a8-h": {"base": "q2-w4a8", "lm_head": "quantized"},
        "w4a16-h": {"base": "q2-w4a16", "lm_head": "quantized"},
        "w4a8-e4-h": {"base": "q2-w4a8", "embedding": "int4", "lm_head": "quantized"},
        "w8a8-h": {"base": "q2-w8a8", "lm_head": "quantized"},
        "w4ax-fp16-head": {"base": "q2-w4ax", "lm_head": "fp16"},
        "w4a8-e4": {"base": "q2-w4a8", "embedding": "int4"}}}))
    return f


def test_the_w4_heads_end_to_end_on_the_shipped_mamba2(tmp_path, capsys):
    modes = ["fp32", "q2-w4a8", "w4a8-h", "q2-w4a16", "w4a16-h", "q2-w4ax", "w4a8-e4-h", "w8a8-h", "w4ax-fp16-head",
             "w4a8-e4"]
    code = run_cli(capture_main, ["--model", TINY2, "--modes", *modes, "--modes_file", _modes(tmp_path),
                                  "--layers", "all", "--end-to-end", "--seq_len", "48", "--calib_data_num", "4",
                                  "--calib_seqlen", "64", "--cache_dir", tmp_path / "cache",
                                  "--output_file", tmp_path / "a.npz"])
    assert code == 0, capsys.readouterr().err
    cap = load_capture(tmp_path / "a.npz")
    stats = cap.manifest
    assert stats["failed_modes"] == []
    kl = {m: stats["end_to_end"][m]["kl"] for m in modes}
    # measured 0.0532 -> 0.0639 (W4A8) and 0.0439 -> 0.0553 (W4A16): the int4 head adds to the blocks' error
    for fp, q in (("q2-w4a8", "w4a8-h"), ("q2-w4a16", "w4a16-h")):
        assert math.isfinite(kl[q]) and kl[fp] < kl[q] < 0.2
        assert not np.array_equal(cap.array(q, "logits"), cap.array(fp, "logits"))
        assert stats["modes"][q]["recipe"]["lm_head"] == "quantized" and "lm_head" not in stats["modes"][fp]["recipe"]
    # q2-w4ax (every layer W4A8) is q2-w4a8 with the int4 embedding and the W4A8 head, bit for bit
    assert np.array_equal(cap.array("q2-w4ax", "logits"), cap.array("w4a8-e4-h", "logits"))
    assert stats["modes"]["q2-w4ax"]["recipe"]["lm_head"] == "quantized"
    # the knob: lm_head=fp16 gives q2-w4ax the fp16 head (what the mode ran before)
    assert np.array_equal(cap.array("w4ax-fp16-head", "logits"), cap.array("w4a8-e4", "logits"))
    assert not np.array_equal(cap.array("w4ax-fp16-head", "logits"), cap.array("q2-w4ax", "logits"))
    # one lm_head:input observation (the W8A8 calibration's) serves q2-w8a8, q2-w4a8 and q2-w4ax; W4A16 needs none
    calib = stats["provenance"]["calibration_by_prep"]
    scales = {k: calib[k].get("lm_head_input_scale") for k in ("quamba2", "quamba2-w4a8", "quamba2-w4ax")}
    assert len(set(scales.values())) == 1 and scales["quamba2"] > 0, scales
    assert sorted(calib[k]["lm_head_input_scale_source"] for k in scales) == ["computed", "reused", "reused"]
    assert "lm_head_input_scale" not in calib["quamba2-w4a16"]


@pytest.mark.parametrize("extra", [["--generate", "3"], ["--decode", "3", "--end-to-end"]])
def test_the_w4_heads_decode_and_generate(tmp_path, capsys, extra):
    args = ["--model", TINY2, "--modes", "fp32", "w4a8-h", "w4a16-h", "--modes_file", _modes(tmp_path),
            "--seq_len", "24", "--calib_data_num", "2", "--calib_seqlen", "64", "--cache_dir", tmp_path / "cache",
            *extra, "--output_file", tmp_path / "a.npz"]
    assert run_cli(capture_main, args) == 0, capsys.readouterr().err
    stats = load_capture(tmp_path / "a.npz").manifest
    assert stats["failed_modes"] == [] and stats["modes"]["w4a8-h"]["status"] == "ok"
    assert stats["modes"]["w4a16-h"]["status"] == "ok"
    assert stats["provenance"]["calibration_by_prep"]["quamba2-w4a8"]["lm_head_input_scale"] > 0


@pytest.mark.parametrize("model, base, message", [
    ("mamba-tiny", "q2-w4a8", "lm_head=quantized are Quamba2's quantized embedding/lm_head"),
    ("bamba-tiny", "q2-w4a8", "lm_head=quantized runs on mamba2 models only"),
    ("bamba-tiny", "q2-w8a8", "lm_head=quantized runs on mamba2 models only"),
])
def test_the_quantized_head_elsewhere_is_exit_2(tmp_path, capsys, model, base, message):
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"modes": {"h": {"base": base, "lm_head": "quantized"}}}))
    code = run_cli(capture_main, ["--model", ROOT / "models" / model, "--modes", "h", "--modes_file", f,
                                  "--seq_len", "16", "--no_cache", "--output_file", tmp_path / "x.npz"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "x.npz").exists()
