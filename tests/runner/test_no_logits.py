"""Issue 21 item 7: --no-logits keeps every array and metric of an --end-to-end run but the logits arrays."""
import json

import numpy as np
import pytest

from harness.cli import capture_main, compare_main
from harness.report.build import report_main
from helpers import FAST_CLI, run_cli, run_modes


@pytest.fixture(scope="module")
def pair(hf_dir, tmp_path_factory):
    """The same end-to-end run (2 samples, every layer, sensitivity) with and without the logits arrays."""
    runs = {}
    for stored in (True, False):
        d = tmp_path_factory.mktemp(f"logits-{stored}")
        out = run_modes(hf_dir, d, ["fp32", "0", "2-4"], layers=["all"], seq_len=32, samples=2, end_to_end=True,
                        sensitivity=True, store_logits=stored)
        runs[stored] = (d / "capture.npz", out.stats)
    return runs


def test_everything_but_the_logits_is_kept_bit_for_bit(pair):
    (with_path, with_stats), (without_path, without_stats) = pair[True], pair[False]
    with np.load(with_path, allow_pickle=False) as a, np.load(without_path, allow_pickle=False) as b:
        logits = {k for k in a.files if k.endswith("__logits")}
        assert logits == {"mode_fp32__logits", "mode_0__logits", "mode_2-4__logits"}
        assert set(b.files) == set(a.files) - logits
        for key in b.files:
            if key != "timestamp":
                assert np.array_equal(a[key], b[key]), key
    assert with_path.stat().st_size > 2 * without_path.stat().st_size  # the logits are most of the file
    for section in ("end_to_end", "sensitivity", "samples", "comparison"):
        assert json.dumps(without_stats[section], sort_keys=True) == json.dumps(with_stats[section], sort_keys=True)
    assert without_stats["comparison"]["modes"]["0"]["logits"]["sqnr_db"] > 0  # compared before it was dropped
    assert with_stats["logits_stored"] is True and without_stats["logits_stored"] is False


def test_compare_and_report_read_a_file_without_logits(pair, capsys):
    assert run_cli(compare_main, [pair[True][0]]) == 0
    assert "\nlogits vs fp32" in capsys.readouterr().out
    path = pair[False][0]
    assert run_cli(compare_main, [path]) == 0
    out = capsys.readouterr().out
    assert "\nL1.block.out vs fp32" in out and "\nlogits vs fp32" not in out
    assert "logits not stored (--no-logits" in out.splitlines()[0]
    assert run_cli(report_main, [path]) == 0
    html = path.with_name("capture_report.html").read_text()
    assert "End to end" in html


def test_capture_option_no_logits(tmp_path, capsys):
    out = tmp_path / "c.npz"
    assert run_cli(capture_main, [*FAST_CLI, "--modes", "fp32", "0", "--no_cache", "--end-to-end", "--no-logits",
                                  "--output_file", out]) == 0
    assert "the logits were not stored (--no-logits)" in capsys.readouterr().out
    with np.load(out, allow_pickle=False) as f:
        assert not [k for k in f.files if "logits" in k] and "mode_0_output" in f.files
    stats = json.loads(out.with_name("c_stats.json").read_text())
    assert stats["logits_stored"] is False and "kl" in stats["end_to_end"]["0"]
