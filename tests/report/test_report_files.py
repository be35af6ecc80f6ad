"""The report's files: permissions from the umask, and never written over a file the report did not write."""
from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from harness.report.build import write_report
from harness.store.format import write_npz

RNG = np.random.default_rng(3)


@pytest.fixture
def capture(tmp_path):
    """A small research-tool file whose mode 0 differs from fp32 (so the report draws one figure)."""
    ref = RNG.standard_normal((1, 8, 4)).astype(np.float32)
    path = tmp_path / "run.npz"
    write_npz(path, {"mode_fp32_output": ref, "mode_0_output": ref * np.float32(1.01)})
    return path


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_report_and_figures_follow_the_umask(capture, tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        out = write_report(capture, tmp_path / "r.html", figures_dir=tmp_path / "figs")
    finally:
        os.umask(old)
    files = [out, *sorted((tmp_path / "figs").iterdir())]
    assert len(files) == 3  # the report, tensor_output.png and .svg
    assert {f.name: stat.S_IMODE(f.stat().st_mode) for f in files} == {f.name: mode for f in files}


def _report(argv, capsys):
    from harness.cli import main

    rc = main(["report", *map(str, argv)])
    return rc, capsys.readouterr().err


def _snapshot(directory):
    return {p.name: (p.read_bytes() if p.is_file() and not p.is_symlink() else os.readlink(p) if p.is_symlink()
                     else None) for p in directory.iterdir()}


@pytest.mark.parametrize("target,fragment", [
    ("run.npz", "it is the capture file of this report"),
    ("run_stats.json", "it is the capture's stats file"),
    (".run_stats.json.pending", "it is the capture's pending stats file"),
    ("notes.html", "exists and is not a file the report wrote"),
    ("link.html", "is a symbolic link"),
])
def test_the_report_never_writes_over_its_inputs_or_a_file_it_did_not_write(capture, tmp_path, capsys, target,
                                                                          fragment):
    from harness.store.format import pending_path, stats_path, write_json

    write_json(stats_path(capture), {"schema_version": 1, "modes": {}})
    pending_path(capture).write_text("{}")
    (tmp_path / "notes.html").write_text("<!DOCTYPE html><p>my notes</p>")
    (tmp_path / "link.html").symlink_to("notes.html")
    before = _snapshot(tmp_path)
    rc, err = _report([capture, "-o", tmp_path / target, "--figures", tmp_path / "figs"], capsys)
    assert rc == 2 and fragment in err and "Traceback" not in err, err
    assert _snapshot(tmp_path) == before       # nothing replaced, no figure folder, no report


def test_the_stats_path_of_a_file_without_stats_is_refused_too(capture, tmp_path, capsys):
    """A research-tool file has no stats yet: a report there would be read as its stats afterwards."""
    rc, err = _report([capture, "-o", tmp_path / "run_stats.json"], capsys)
    assert rc == 2 and "it is the capture's stats file" in err
    assert not (tmp_path / "run_stats.json").exists()


def test_a_figure_file_the_report_did_not_write_is_never_replaced(capture, tmp_path, capsys):
    figs = tmp_path / "figs"
    figs.mkdir()
    (figs / "tensor_output.svg").write_text("<?xml version='1.0'?><svg>my drawing</svg>")
    rc, err = _report([capture, "-o", tmp_path / "r.html", "--figures", figs], capsys)
    assert rc == 2 and "tensor_output.svg: it exists and is not a file the report wrote" in err, err
    assert sorted(p.name for p in figs.iterdir()) == ["tensor_output.svg"] and not (tmp_path / "r.html").exists()
    assert (figs / "tensor_output.svg").read_text() == "<?xml version='1.0'?><svg>my drawing</svg>"


def test_the_report_replaces_its_own_report_and_figures(capture, tmp_path, capsys):
    out, figs = tmp_path / "run_report.html", tmp_path / "figs"
    assert _report([capture, "--figures", figs], capsys)[0] == 0
    first = _snapshot(figs)
    os.utime(out, (0, 0))
    assert _report([capture, "--figures", figs], capsys)[0] == 0      # its own files: replaced
    assert out.stat().st_mtime > 0 and _snapshot(figs) == first
    html = out.read_text()
    assert html.startswith("<!DOCTYPE html>") and '<meta name="generator" content="quamba-harness report">' in html
    # a report written before the mark existed is recognised by its title
    legacy = html.replace('<meta name="generator" content="quamba-harness report">', "")
    out.write_text(legacy)
    assert _report([capture], capsys)[0] == 0 and out.read_text() == html


def test_capture_report_refuses_a_foreign_report_path_before_any_work(tmp_path, capsys):
    from conftest import make_hf_model, write_hf_dir
    from harness.cli import capture_main

    model = write_hf_dir(tmp_path / "m", make_hf_model(n_layer=1, seed=2))
    (tmp_path / "c_report.html").write_text("mine")
    rc = capture_main(["--model", str(model), "--modes", "fp32", "--output_file", str(tmp_path / "c.npz"),
                       "--no_cache", "--seq_len", "16", "--report"])
    err = capsys.readouterr().err
    assert rc == 2 and "c_report.html: it exists and is not a file the report wrote" in err, err
    assert not (tmp_path / "c.npz").exists() and (tmp_path / "c_report.html").read_text() == "mine"


def research_file_of_many_modes(path, n_modes: int, seed: int = 21):
    """A research-layout file: fp32 and n_modes - 1 other modes x (input, output, residual) of [1, 4, 8]; every
    7th mode equals fp32, the input is the same in every mode."""
    rng = np.random.default_rng(seed)
    ref = {t: rng.standard_normal((1, 4, 8)).astype(np.float32) for t in ("input", "output", "residual")}
    arrays = {}
    for i in range(n_modes):
        mode = "fp32" if i == 0 else f"m{i}"
        for t, r in ref.items():
            same = i == 0 or t == "input" or i % 7 == 1
            arrays[f"mode_{mode}_{t}"] = r if same else r + np.float32(1e-3 * i)
    write_npz(path, arrays)


def test_a_report_of_300_modes_does_work_linear_in_the_modes(tmp_path, monkeypatch):
    """Issue 21 15d: 2000 modes made report and compare run past 10 minutes (every mode compared with every
    group of identical modes, every mode a line and a legend entry in every figure). Counted here: array
    comparisons (the former code made about n^2/2 = 45,000 for 300 modes) and lines and legend entries."""
    import harness.metrics.compare as compare
    import harness.report.sections as sections
    from harness.report.groups import MAX_SERIES

    research_file_of_many_modes(tmp_path / "many.npz", 300)
    calls, figures = [], []
    real = compare._equal
    monkeypatch.setattr(compare, "_equal", lambda a, b: calls.append(1) or real(a, b))
    monkeypatch.setattr(sections, "render", lambda fig, fmt="png": figures.append(fig) or b"\x89PNG")
    out = write_report(tmp_path / "many.npz", tmp_path / "many.html")
    html = out.read_text()
    assert len(calls) <= 2 * 3 * 300                         # metrics' identical flags + confirming hash matches
    assert "fp32 = m1 = m8 = m15" in html                    # the identical group, found by hashing
    assert len(figures) == 2                                 # output and residual; the input is the same everywhere
    for fig in figures:
        entries = [t for legend in fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
                   for t in legend.get_texts()]
        assert len(entries) <= MAX_SERIES + 1                # the worst groups and the reference's histogram
        assert all(len(ax.lines) <= MAX_SERIES for ax in fig.axes)
        assert fig.legends[0].get_title().get_text() == "244 more modes not drawn"   # 299 - 43 equal to fp32 - 12
