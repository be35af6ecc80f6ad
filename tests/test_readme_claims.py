"""What the README says about a run, checked against the code (issue 21 item 20)."""
from __future__ import annotations

import re
from pathlib import Path

from helpers import run_modes

ROOT = Path(__file__).resolve().parent.parent


def test_lm_head_runs_only_with_end_to_end_or_sensitivity_as_the_readme_says(hf_dir, tmp_path, monkeypatch):
    import harness.runner.forwards as forwards

    built = []
    real = forwards.build_head
    monkeypatch.setattr(forwards, "build_head", lambda *a, **k: built.append(1) or real(*a, **k))
    for name in ("plain", "e2e"):
        (tmp_path / name).mkdir()
    run_modes(hf_dir, tmp_path / "plain", ["fp32", "0"], seq_len=16)
    assert built == []                                       # a plain capture stops after the deepest block
    run_modes(hf_dir, tmp_path / "e2e", ["fp32", "0"], seq_len=16, end_to_end=True)
    assert len(built) == 2                                   # one head per mode
    readme = " ".join((ROOT / "README.md").read_text().split())
    # the one README sentence on lm_head's arithmetic says when it runs (it listed lm_head among the GEMMs
    # every run does, beside the calibration forward)
    assert "float GEMMs (the float modes, the calibration forward, lm_head, which runs only with `--end-to-end` " \
           "or `--sensitivity`: a plain capture stops after the deepest captured block)" in readme


def test_the_report_screenshot_is_the_summary_screen_the_docs_command_makes():
    from PIL import Image

    command = re.search(r"docs/report\.png (\d+) (\d+)", (ROOT / "tests" / "fixtures" / "browser.py").read_text())
    assert command, "tests/fixtures/browser.py documents the command that makes docs/report.png"
    with Image.open(ROOT / "docs" / "report.png") as img:
        assert img.size == (int(command.group(1)), int(command.group(2)))
    assert "the first screen of the `make run` report: the summary" in (ROOT / "docs" / "report.md").read_text()


def test_the_readme_python_example_uses_the_cache_and_a_short_calibration(tmp_path, monkeypatch):
    """The README's "From Python" block, run with `run` recorded: its RunConfig calibrates 64 windows of 512
    tokens into the command line's default cache (it recalibrated 512 x 512 on every call, in silence)."""
    import harness
    from harness.runner.calibration import default_cache_dir

    readme = (ROOT / "README.md").read_text()
    block = readme.split("## From Python\n\n```python\n", 1)[1].split("```", 1)[0]
    seen = []

    class Out:
        stats = {"comparison": {"modes": {"0": {"output": {"sqnr_db": 30.0}}}}}

    monkeypatch.setattr(harness, "run", lambda cfg, *a, **k: seen.append(cfg) or Out(), raising=False)
    monkeypatch.setenv("QUAMBA_HARNESS_CACHE", str(tmp_path / "cache"))
    exec(compile(block, "README.md", "exec"), {"print": lambda *_a: None})
    (cfg,) = seen
    assert cfg.cache_dir == default_cache_dir() == tmp_path / "cache"
    assert (cfg.calib.num_samples, cfg.calib.seqlen) == (64, 512) and cfg.modes == ["fp32", "0"]
