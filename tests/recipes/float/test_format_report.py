"""The report's Number formats section (report --formats): present only when asked, its numbers the sweep's."""
import numpy as np
import pytest
import torch

from harness.metrics.formats import format_errors
from harness.report.build import build_report, report_main
from harness.report.html import fmt_value


def _file(tmp_path):
    x = np.random.default_rng(2).standard_normal((1, 8, 64)).astype(np.float32)
    np.savez(tmp_path / "r.npz", mode_fp32_input=x, mode_fp32_output=3 * x, **{"mode_2-0_output": x + 1})
    return tmp_path / "r.npz", x


def test_section_only_when_asked_and_with_the_sweeps_numbers(tmp_path):
    path, x = _file(tmp_path)
    plain, _ = build_report(path, "fp32")
    assert 'id="formats"' not in plain
    html, names = build_report(path, "fp32", formats=["hifp8", "mxfp4_e2m1"])
    assert 'id="formats"' in html and "formats_rates" in names and "formats_hist_input" in names
    sqnr = format_errors(torch.from_numpy(3 * x), "mxfp4_e2m1")["sqnr_db"]
    assert f"<td>{fmt_value(sqnr)}</td>" in html


def test_report_cli_formats_option(tmp_path, capsys):
    path, _ = _file(tmp_path)
    assert report_main([str(path), "-o", str(tmp_path / "a.html"), "--formats"]) == 0
    assert 'id="formats"' in (tmp_path / "a.html").read_text()
    with pytest.raises(SystemExit) as e:
        report_main([str(path), "--formats", "fp7"])
    assert e.value.code == 2 and "invalid choice: 'fp7'" in capsys.readouterr().err


def test_report_formats_with_an_empty_tensor_says_it_is_empty(tmp_path):
    x = np.random.default_rng(4).standard_normal((1, 8, 64)).astype(np.float32)
    for shape in ((1, 0, 128), (1, 8, 0)):
        path = tmp_path / "e.npz"
        np.savez(path, mode_fp32_input=np.zeros(shape, np.float32), mode_fp32_output=x, **{"mode_0_output": x + 1})
        html, names = build_report(path, "fp32", formats=["bf16", "mxfp4_e2m1"])
        assert f"input: the tensor is empty (shape {list(shape)}): it holds no values to represent" in html
        sqnr = format_errors(torch.from_numpy(x), "mxfp4_e2m1")["sqnr_db"]
        assert f"<td>{fmt_value(sqnr)}</td>" in html and "formats_rates" in names
        assert report_main([str(path), "-o", str(tmp_path / "e.html"), "--formats"]) == 0
