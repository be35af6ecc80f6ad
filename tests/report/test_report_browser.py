"""The HTML report of a real run in a real browser: headless Chromium (Debian's package; `make test` installs it).

Checks that every image decodes, nothing is requested from the network, the console stays free of
errors, the page fits a laptop's width, and a screenshot is not blank.
"""
from __future__ import annotations

import io

import numpy as np
import pytest

from browser import chromium_path, inspect
from harness.report.build import write_report
from helpers import run_modes

pytestmark = [
    pytest.mark.skipif(chromium_path() is None, reason="chromium is not installed and could not be: `make test` "
                       "installs Debian's chromium with apt-get when run as root"),
]
playwright = pytest.importorskip("playwright", reason="playwright (the test extra) is not installed")


def _variance(png: bytes) -> float:
    from PIL import Image

    return float(np.asarray(Image.open(io.BytesIO(png)).convert("L"), dtype=np.float64).var())


def test_report_of_a_real_run_loads_offline_in_chromium(hf_dir, tmp_path):
    run_modes(hf_dir, tmp_path, ["fp32", "0", "2-4"], layers=[0, 1], taps=["norm.out", "x_proj.in"], seq_len=32)
    report = write_report(tmp_path / "capture.npz")
    seen = inspect(report, tmp_path / "shot.png", width=1280)
    assert len(seen["images"]) >= 4                                   # layers, taps, tensors
    for img in seen["images"]:
        assert img["complete"] and img["width"] > 0 and img["height"] > 0, img
    assert seen["network"] == [] and seen["console_errors"] == [] and seen["page_errors"] == []
    assert seen["scroll_width"] <= 1280                               # no horizontal scrolling at laptop width
    assert _variance(seen["screenshot"]) > 100.0                      # not a blank page
    assert (tmp_path / "shot.png").read_bytes() == seen["screenshot"]


def test_the_browser_check_catches_network_requests_and_broken_images(tmp_path):
    page = tmp_path / "bad.html"
    page.write_text('<!DOCTYPE html><html><body><img src="https://example.invalid/x.png">'
                    '<img src="data:image/png;base64,AAAA"><script>console.error("boom")</script></body></html>')
    seen = inspect(page, tmp_path / "bad.png")
    assert seen["network"] == ["https://example.invalid/x.png"]
    assert [img["width"] for img in seen["images"]] == [0, 0]
    assert "boom" in seen["console_errors"]
    assert _variance(seen["screenshot"]) < 10.0                       # blank but for two broken-image icons


def test_the_summary_fills_the_first_screen_and_the_page_stays_short(hf_dir, tmp_path):
    """Issue 21 19: the report of a whole-model analysis was 26,000 px tall (about 36 bar charts across samples,
    every per-tensor figure open) with no summary. The summary is now the first section and fits the first
    screen; the page of this run (2 layers, isolated, end to end, 2 samples, sensitivity, 5 modes) measured
    17,058 px before and 5,233 px after at 1280 px wide."""
    run_modes(hf_dir, tmp_path, ["fp32", "0", "2-0", "2-1", "2-4"], layers=[0, 1], seq_len=32, isolated=True,
              samples=2, sensitivity=True, end_to_end=True)
    report = write_report(tmp_path / "capture.npz")
    seen = inspect(report, tmp_path / "shot.png", width=1280, height=1000)
    assert seen["page_errors"] == [] and seen["network"] == []
    first = min(seen["sections"], key=lambda s: seen["sections"][s]["top"])
    summary = seen["sections"]["summary"]
    assert first == "summary" and summary["top"] + summary["height"] <= 1000      # one screen, at the top
    assert _variance(seen["screenshot"]) > 100.0
    assert seen["scroll_height"] < 8000                                         # 17,058 px before
    html = report.read_text()
    assert "<b>Worst mode:</b>" in html and "<b>Worst layer by KL:</b> layer" in html and "Error first jumps" in html
