"""The format sweep: the metrics of one tensor in a format (harness.metrics.formats), the sweep of a capture file
(ours and the research tool's), and `python -m harness formats` (the list, the table, --json, exit 2)."""
import json
import math
import re

import numpy as np
import pytest
import torch

from harness.cli import main
from harness.formats import FORMATS, fake_quantize
from harness.metrics.formats import FORMAT_METRICS, format_errors, reference
from harness.report.formats import sweep_file
from harness.store.format import write_pair
from helpers import run_cli


def test_one_reference_serves_every_format_with_the_numbers_of_a_direct_computation():
    """The sweep computes what the metrics need of x once per tensor (reference) and reuses it for every format:
    with non-finite elements in x, per format, the numbers equal a direct numpy computation over x's finite
    elements, and the outlier fraction is per block size (16 for nvfp4, 32 for MX)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, generator=g)
    x[0, 0] = 40.0                                       # an outlier: its 16- and 32-blocks' scale
    x[1, 5], x[2, 9], x[3, 3] = math.nan, math.inf, 0.0
    ref = reference(x)
    fin = torch.isfinite(x).numpy()
    xs = x.double().numpy()[fin]
    for fmt in ("nvfp4", "mxfp8_e4m3", "int8", "hifp8", "bf16"):
        shared, alone = format_errors(x, fmt, ref), format_errors(x, fmt)
        assert json.dumps(shared, sort_keys=True) == json.dumps(alone, sort_keys=True)  # NaN equal to NaN
        y = fake_quantize(x, fmt).double().numpy()[fin]
        d = y - xs
        with np.errstate(invalid="ignore"):
            assert shared["mse"] == pytest.approx(np.mean(d * d), rel=1e-12, nan_ok=True)
            assert shared["max_abs"] == pytest.approx(np.abs(d).max(), nan_ok=True)
        assert shared["underflow"] == np.sum((y == 0) & (xs != 0)) / np.sum(xs != 0)
        assert shared["overflow"] == np.sum(~np.isfinite(y)) / xs.size
    # 16 blocks of 16 (one holds the outlier) vs 8 blocks of 32; the NaN/inf blocks are not counted as outliers
    assert ref.outliers[16] == format_errors(x, "nvfp4")["outlier_blocks"]
    assert ref.outliers[32] == format_errors(x, "mxfp8_e4m3")["outlier_blocks"] != ref.outliers[16]


def test_metrics_against_their_definitions():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, generator=g)
    for fmt in ("hifp8", "mxfp4_e2m1", "int8"):
        m = format_errors(x, fmt)
        d = (fake_quantize(x, fmt).double() - x.double()).numpy()
        xs = x.double().numpy()
        assert m["mse"] == pytest.approx(np.mean(d * d), rel=1e-12)
        assert m["rel_l2"] == pytest.approx(np.linalg.norm(d) / np.linalg.norm(xs), rel=1e-12)
        assert m["sqnr_db"] == pytest.approx(10 * np.log10(np.sum(xs * xs) / np.sum(d * d)), rel=1e-12)
        assert m["max_abs"] == np.abs(d).max()
        assert set(m) == set(FORMAT_METRICS)


def test_overflow_underflow_of_hifp8():
    x = torch.tensor([1.0, 5e4, 2.0 ** -25, 3.0, 0.0, -1e6, 2.0 ** -30, 7.0])
    m = format_errors(x, "hifp8")
    assert m["overflow"] == 2 / 8                       # 5e4 and -1e6 -> inf
    assert m["underflow"] == 2 / 7                      # 2^-25 and 2^-30 flush (the zero is not counted)
    assert m["mse"] == math.inf and m["sqnr_db"] == -math.inf and m["outlier_blocks"] is None


def test_a_tensor_without_a_finite_element_has_nan_averages():
    """No finite element (an all-NaN/inf capture): the averages over the finite elements are NaN (not a
    ZeroDivisionError), and no element counts as lost, flushed or saturated."""
    x = torch.tensor([math.nan, math.inf, -math.inf, math.nan])
    for fmt in ("int8", "hifp8", "bf16"):
        m = format_errors(x, fmt)
        assert math.isnan(m["mse"]) and math.isnan(m["sqnr_db"]) and math.isnan(m["max_abs"])
        assert m["rel_l2"] == 0.0 and m["overflow"] == m["underflow"] == m["saturated"] == 0.0


def test_saturation_by_the_mx_floor_scale_and_int4_positive_side():
    x = torch.zeros(2, 32)
    x[0, 0], x[0, 1] = 7.0, 1.0    # amax 7: E8M0 floor scale 2^(2-2) = 1, 7 clamps to 6
    x[1, 0], x[1, 1] = 4.4, 1.0    # amax 4.4: scale 1, 4.4 rounds to 4 (no clamp)
    m = format_errors(x, "mxfp4_e2m1")
    assert m["saturated"] == 1 / 64 and m["overflow"] == 0
    assert format_errors(x, "mxfp8_e4m3")["saturated"] == 0  # 7 * 2^6 = 448 at scale 2^-6
    x[0, 0] = 7.5                                            # 480 > 448: e4m3 saturates too
    assert format_errors(x, "mxfp8_e4m3")["saturated"] == 1 / 64
    y = torch.zeros(128)
    y[0] = 1.0                                               # +a: at most 7s = 7a/7.5 above zero
    assert format_errors(y, "int4_g128")["saturated"] == 1 / 128
    assert format_errors(-y, "int4_g128")["saturated"] == 0  # -a: -8s covers it


def test_outlier_blocks_count_groups_whose_top_value_doubles_the_next():
    x = torch.ones(4, 32) * torch.linspace(0.5, 1.0, 32)
    x[1, 3] = 100.0                # one outlier
    x[2, 3], x[2, 4] = 100.0, 60.0  # two large values: not one outlier
    x[3] = 0.0                     # all zero: no outlier
    assert format_errors(x, "mxfp8_e4m3")["outlier_blocks"] == 1 / 4
    assert format_errors(x, "nvfp4")["outlier_blocks"] == 1 / 8    # blocks of 16: 8 of them
    assert format_errors(x, "fp8_e4m3")["outlier_blocks"] is None  # no blocks


def _ours(tmp_path):
    g = np.random.default_rng(0)
    arrays = {"mode_fp32_input": g.standard_normal((1, 8, 64)).astype(np.float32),
              "mode_fp32_output": g.standard_normal((1, 8, 64)).astype(np.float32),
              "mode_0__L0.x_proj.out": g.standard_normal((1, 8, 40)).astype(np.float32),
              "token_ids": np.arange(8, dtype=np.int64).reshape(1, 8)}
    path = tmp_path / "ours.npz"
    write_pair(path, arrays, {"schema_version": 2, "modes": {"fp32": {}, "0": {}}})
    return path, arrays


def test_sweep_of_our_file_equals_the_metrics_per_tensor(tmp_path):
    path, arrays = _ours(tmp_path)
    result = sweep_file(path, ["hifp8", "mxfp8_e4m3", "bf16"])
    assert result["formats"] == ["hifp8", "mxfp8_e4m3", "bf16"]
    assert set(result["modes"]) == {"fp32", "0"} and set(result["modes"]["fp32"]) == {"input", "output"}
    want = format_errors(torch.from_numpy(arrays["mode_fp32_output"]), "hifp8")
    assert result["modes"]["fp32"]["output"]["hifp8"] == want
    # x_proj's last dim 40 is not a multiple of 32: the MX row says why, the others are computed
    assert "not a multiple of its block size 32" in result["modes"]["0"]["L0.x_proj.out"]["mxfp8_e4m3"]["not_applicable"]
    assert "mse" in result["modes"]["0"]["L0.x_proj.out"]["hifp8"]


def test_sweep_of_a_research_tool_file(tmp_path):
    """The research tool's layout: mode_<m>_input / _output, token_ids and string metadata, no manifest."""
    x = np.random.default_rng(1).standard_normal((1, 4, 32)).astype(np.float32)
    np.savez_compressed(tmp_path / "old.npz", timestamp=np.array("2025-11-10"), model=np.array("quamba-130m-w8a8"),
                        seq_len=np.array(4), token_ids=np.arange(4).reshape(1, 4), mode_fp32_input=x,
                        mode_fp32_output=2 * x, **{"mode_2-0_output": x + 1})
    result = sweep_file(tmp_path / "old.npz", modes=["fp32", "2-0"], tensors=["output"])
    assert set(result["modes"]) == {"fp32", "2-0"} and list(result["modes"]["fp32"]) == ["output"]
    assert list(result["modes"]["2-0"]["output"]) == list(FORMATS)
    assert result["modes"]["fp32"]["output"]["mxfp4_e2m1"] == format_errors(torch.from_numpy(2 * x), "mxfp4_e2m1")


def test_cli_lists_the_formats(capsys):
    assert main(["formats"]) == 0
    out = capsys.readouterr().out
    for f in FORMATS.values():
        assert f.name in out
    assert "bits/value" in out and "E8M0 per 32" in out


def test_cli_table_and_json(tmp_path, capsys):
    path, _ = _ours(tmp_path)
    out_json = tmp_path / "sweep.json"
    assert main(["formats", str(path), "--formats", "int8", "mxfp4_e2m1", "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "mode fp32" in text and "mxfp4_e2m1" in text and "n/a: mxfp4_e2m1 needs a last dimension" in text
    data = json.loads(out_json.read_text())
    assert data["modes"]["fp32"]["input"]["int8"]["sqnr_db"] == pytest.approx(
        sweep_file(path, ["int8"])["modes"]["fp32"]["input"]["int8"]["sqnr_db"])
    assert main(["formats", str(path), "--formats", "bf16", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["formats"] == ["bf16"]


@pytest.mark.parametrize("argv,message", [
    (["--formats", "fp7"], "--formats fp7 matches nothing; valid: bf16, fp16"),
    (["--modes", "9"], "--modes 9 matches nothing in"),
    (["--tensors", "nope"], "--tensors nope matches nothing in"),
    (["--formats", "mxfp4_e2m1", "--tensors", "L0.x_proj.out"],
     r"0 L0.x_proj.out \[1, 8, 40\]: format mxfp4_e2m1: the last dimension \(40\) is not a multiple of its block size 32"),
])
def test_cli_bad_names_exit_2(tmp_path, capsys, argv, message):
    path, _ = _ours(tmp_path)
    assert run_cli(main, ["formats", path, *argv]) == 2
    assert re.search(message, capsys.readouterr().err)


def test_cli_missing_file_and_json_over_input_exit_2(tmp_path, capsys):
    assert run_cli(main, ["formats", tmp_path / "none.npz"]) == 2
    assert "does not exist" in capsys.readouterr().err
    path, _ = _ours(tmp_path)
    before = path.read_bytes()
    assert run_cli(main, ["formats", path, "--json", path]) == 2
    assert path.read_bytes() == before
    # another capture's stats (a NAME_stats.json beside a NAME.npz, or one with schema_version): left alone
    (tmp_path / "o").mkdir()
    other, _ = _ours(tmp_path / "o")
    kept = tmp_path / "kept.json"
    kept.write_bytes(other.with_name("ours_stats.json").read_bytes())
    for target in (other.with_name("ours_stats.json"), kept, other):
        before = target.read_bytes()
        assert run_cli(main, ["formats", path, "--json", target]) == 2
        assert target.read_bytes() == before and "cannot write" in capsys.readouterr().err
    assert run_cli(main, ["formats", "--modes", "0"]) == 2


def test_an_empty_tensor_gets_a_row_saying_so(tmp_path, capsys):
    """Shapes [1, 0, 128] and [1, 8, 0]: a RuntimeError / IndexError traceback before; now every format says
    the tensor is empty, in the table, in --json and when the tensor and formats are named."""
    x = np.random.default_rng(3).standard_normal((1, 4, 64)).astype(np.float32)
    path = tmp_path / "e.npz"
    np.savez(path, mode_fp32_input=np.zeros((1, 0, 128), np.float32), mode_fp32_output=x,
             **{"mode_0_output": np.zeros((1, 8, 0), np.float32), "mode_0_input": x})
    result = sweep_file(path, ["bf16", "mxfp4_e2m1", "nvfp4"])
    for mode, tensor, shape in (("fp32", "input", [1, 0, 128]), ("0", "output", [1, 8, 0])):
        assert result["modes"][mode][tensor] == {f: {"not_applicable": f"the tensor is empty (shape {shape}): it "
                                                     "holds no values to represent"} for f in result["formats"]}
    assert result["modes"]["fp32"]["output"]["bf16"] == format_errors(torch.from_numpy(x), "bf16")
    assert run_cli(main, ["formats", path, "--json", tmp_path / "e.json"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^input +all +empty", out, re.M) and re.search(r"^output +all +empty", out, re.M)
    assert "input: the tensor is empty (shape [1, 0, 128])" in out and "output: the tensor is empty (shape [1, 8, 0])" in out
    assert json.loads((tmp_path / "e.json").read_text())["modes"]["0"]["output"]["int8"]["not_applicable"]
    assert run_cli(main, ["formats", path, "--tensors", "output", "--formats", "mxfp8_e4m3"]) == 0
    assert "output: the tensor is empty" in capsys.readouterr().out
