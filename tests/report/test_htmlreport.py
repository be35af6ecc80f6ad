"""The HTML report: figure functions on small arrays, reports of synthetic, research-tool and real files."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
from matplotlib.figure import Figure

from harness.cli import main
from harness.metrics.compare import CompareError
from harness.report import figures as F
from harness.report.build import build_report, report_path, write_report
from harness.report.data import load_report_data
from harness.metrics.errors import sqnr_db
from harness.store.format import SCHEMA_VERSION, stats_path, write_json, write_npz
from helpers import run_modes

RNG = np.random.default_rng(0)
COLORS = F.mode_colors(["fp32", "0", "2-4"])


def _ax():
    return Figure().add_subplot()


def _vlines(ax) -> list[float]:
    return sorted(float(line.get_xdata()[0]) for line in ax.lines if len(set(line.get_xdata())) == 1)


# ---------------------------------------------------------------- figure functions


def test_value_distribution_draws_clip_lines_at_127_5_scale_and_names_fractions():
    ref = RNG.standard_normal((1, 16, 8))
    ax = _ax()
    grids = {"0": {"scale": 0.02, "saturated_fraction": 0.125, "clipped_fraction": 0.0625}, "2-4": {"scale": 0.01}}
    assert F.value_distribution(ax, ref, {"0": ref + 0.01, "2-4": ref}, COLORS, grids)
    assert _vlines(ax) == pytest.approx([-2.55, -1.275, 1.275, 2.55])   # 127.5 * 0.02, 127.5 * 0.01
    labels = [t.get_text() for t in ax.legend().get_texts()]
    assert "0 grid ±2.55, sat 12.5%, clip 6.25%" in labels and "2-4 grid ±1.275" in labels
    assert ax.get_yscale() == "log" and "127.5" in ax.get_title()
    # the x range reaches the clip lines even when no value does
    assert ax.get_xlim()[0] <= -2.55 and ax.get_xlim()[1] >= 2.55


def test_error_histogram_is_log_count_and_counts_every_element():
    d = np.concatenate([np.zeros(90), np.full(10, 0.5)])
    ax = _ax()
    assert F.error_histogram(ax, {"0": d}, COLORS)
    assert ax.get_yscale() == "log" and ax.get_xlabel() == "error"
    counts = ax.patches[0].get_data().values
    assert counts.sum() == 100 and counts.max() == 90
    assert not F.error_histogram(_ax(), {"0": np.array([np.nan])}, COLORS)


def test_error_vs_magnitude_follows_a_relative_error():
    ref = RNG.uniform(-4, 4, size=4000)
    ax = _ax()
    assert F.error_vs_magnitude(ax, ref, {"0": 0.1 * ref}, COLORS, n_bins=10)
    x, y = ax.lines[0].get_xdata(), ax.lines[0].get_ydata()
    assert len(x) == 10 and np.all(np.diff(x) > 0)
    assert y == pytest.approx(0.1 * x, rel=1e-9)  # mean |0.1 r| over a bin = 0.1 * mean |r|


def test_error_per_token_and_per_channel_reduce_the_right_axes():
    d = np.zeros((1, 6, 4))
    d[0, 2, :] = 2.0          # token 2 wrong in every channel
    d[0, :, 3] += 1.0         # channel 3 wrong at every token
    ax = _ax()
    assert F.error_per_token(ax, {"0": d}, COLORS)
    per_token = ax.lines[0].get_ydata()
    assert np.argmax(per_token) == 2 and per_token[0] == pytest.approx(0.5)  # sqrt(1/4)
    prof = F.channel_profile(d)
    assert np.argmax(prof) == 3 and prof[0] == pytest.approx(np.sqrt(4 / 6))
    assert F.channel_profile(np.ones((1, 2, 1000)), max_columns=100).shape == (100,)
    stacked = np.stack([d, d])                # a leading sample axis pools like the batch axis
    assert F.channel_profile(stacked) == pytest.approx(prof)
    ax2 = Figure().add_subplot()
    assert F.error_per_channel(ax2, {"0": d, "2-4": d * 2}) and [t.get_text() for t in ax2.get_yticklabels()] == ["0", "2-4"]


def test_tensor_figure_has_five_panels_and_none_without_errors():
    ref = RNG.standard_normal((1, 12, 6)).astype(np.float32)
    assert F.tensor_figure("t", ref, {"0": ref.copy()}, COLORS) is None      # identical: nothing to draw
    assert F.tensor_figure("t", ref, {}, COLORS) is None
    fig = F.tensor_figure("output against fp32", ref, {"0": ref + 0.1, "2-4": ref.copy()}, COLORS,
                          {"0": {"scale": 0.05}})
    titles = [a.get_title() for a in fig.axes]
    assert titles[:5] == ["error histogram (mode - reference)", "values and int8 clip lines (±127.5·scale)",
                          "mean |error| vs reference magnitude", "RMS error per token", "RMS error per channel"]
    assert [t.get_text() for t in fig.axes[4].get_yticklabels()] == ["0"]  # the identical mode is left out
    assert fig.get_suptitle() == "output against fp32"
    state = F.tensor_figure("s", ref, {"0": ref + 1}, COLORS, axes=("channel", "state"))
    assert state.axes[3].get_xlabel() == "channel" and state.axes[4].get_xlabel() == "state"


def test_taps_figure_bars_are_the_fractions_and_scales():
    taps = {"norm.out": {"0": {"scale": 0.5, "saturated_fraction": 0.25, "clipped_fraction": 0.125}},
            "ssm.out": {"0": {"scale": None}}}
    fig = F.taps_figure("layer 0", taps, COLORS)
    sat, clip, scale = fig.axes
    assert [p.get_height() for p in sat.patches] == [0.25] and [p.get_height() for p in clip.patches] == [0.125]
    assert [p.get_height() for p in scale.patches] == [0.5] and scale.get_yscale() == "log"
    assert [t.get_text() for t in scale.get_xticklabels()] == ["norm.out"]      # float taps have no bars
    assert F.taps_figure("x", {"ssm.out": {"0": {"scale": None}}}, COLORS) is None


def test_layer_sqnr_figure_accumulated_and_isolated_on_one_chart():
    fig = F.layer_sqnr_figure([0, 1, 2], {"0": [30.0, 25.0, 20.0]}, {"0": [30.0, 29.0, float("inf")]}, COLORS)
    ax = fig.axes[0]
    assert [line.get_label() for line in ax.lines] == ["0 accumulated", "0 isolated"]
    assert list(ax.lines[0].get_ydata()) == [30.0, 25.0, 20.0] and ax.lines[1].get_linestyle() == "--"
    assert np.isnan(ax.lines[1].get_ydata()[2])   # +inf (no error) is not drawn
    assert F.layer_sqnr_figure([0], {"0": [30.0]}, {}, COLORS) is None


def test_end_to_end_and_samples_figures_show_means_and_intervals():
    e2e = {"fp32": {"kl": 0.0, "top1_agreement": 1.0, "perplexity": 9.0},
           "0": {"kl": {"mean": 0.2, "ci95": [0.1, 0.35]}, "top1_agreement": 0.9, "perplexity": 9.5}}
    fig = F.end_to_end_figure(e2e, COLORS)
    kl = fig.axes[0]
    assert kl.get_title().startswith("mean KL") and [p.get_height() for p in kl.patches] == [0.0, 0.2]
    segments = kl.collections[0].get_segments()      # the error bar of mode 0 spans its interval
    assert segments[1][:, 1] == pytest.approx([0.1, 0.35])
    assert F.end_to_end_figure({"0": {"other": 1}}, COLORS) is None


def _outside(fig, ax, legend) -> bool:
    """The legend's box lies right of the axes' box (drawn off the data)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()
    return legend.get_window_extent(renderer).x0 >= ax.get_window_extent(renderer).x1


def test_layer_sqnr_figure_draws_coinciding_modes_once_named_together_legend_off_the_data():
    """Issue 21 19: 14 lines of which five coincided, unnamed, under a 14-entry legend inside the axes."""
    acc = {"0": [30.0, 25.0, 20.0], "2-0": [30.0, 25.0, 20.0], "2-4": [31.0, 28.0, 26.0]}
    iso = {"0": [30.0, 29.0, 28.0], "2-0": [30.0, 29.0, 28.0], "2-4": [31.0, 30.0, 29.0]}
    colors = F.mode_colors(["fp32", "0", "2-0", "2-4"])
    fig = F.layer_sqnr_figure([0, 1, 2], acc, iso, colors)
    ax = fig.axes[0]
    assert [line.get_label() for line in ax.lines] == ["0 = 2-0 accumulated", "0 = 2-0 isolated", "2-4 accumulated",
                                                      "2-4 isolated"]
    assert _outside(fig, ax, ax.get_legend())
    many = {f"m{i}": [30.0 - i, 25.0 - i, 20.0 - i] for i in range(40)}       # 40 modes: the 12 lowest are drawn
    fig = F.layer_sqnr_figure([0, 1, 2], many, {}, F.mode_colors(list(many)))
    ax = fig.axes[0]
    assert len(ax.lines) == 12 and ax.lines[0].get_label() == "m28 accumulated"
    assert ax.get_legend().get_title().get_text() == "28 more modes not drawn"


def test_tensor_figure_draws_equal_arrays_once_and_says_a_float_tensor_has_no_clip_lines():
    ref = np.random.default_rng(19).standard_normal((1, 12, 6)).astype(np.float32)  # own RNG: later tests' draws stay
    colors = F.mode_colors(["fp32", "0", "2-0", "2-4"])
    fig = F.tensor_figure("t", ref, {"0": ref + 0.1, "2-0": ref + 0.1, "2-4": ref * 1.5}, colors)
    assert [t.get_text() for t in fig.axes[4].get_yticklabels()] == ["0 = 2-0", "2-4"]
    assert [line.get_label() for line in fig.axes[3].lines] == ["0 = 2-0", "2-4"]
    assert fig.axes[1].get_title() == "values (float in every mode shown: no int8 grid, no clip lines)"
    assert _vlines(fig.axes[1]) == []
    assert not any(ax.get_legend() for ax in fig.axes) and len(fig.legends) == 1   # one legend, beside the panels
    assert all(_outside(fig, ax, fig.legends[0]) for ax in fig.axes[:4])


def test_the_worst_value_is_highlighted_in_every_row_that_shows_it_and_in_none_when_all_show_the_same():
    from harness.report.html import comparison_table

    rows = {"a": {"sqnr_db": 20.000001, "mse": 0.5}, "b": {"sqnr_db": 20.000002, "mse": 0.5000001},
            "c": {"sqnr_db": 30.0, "mse": 0.5}}
    html = comparison_table("t", rows, "fp32", {})
    cells = re.findall(r"<tr>(.*?)</tr>", html)[1:]
    sqnr = [re.findall(r"<td[^>]*>", row)[7] for row in cells]           # mode, MSE, ..., SQNR dB
    assert sqnr == ['<td class="worst">', '<td class="worst">', "<td>"]   # both show 20: both highlighted
    mse = [re.findall(r"<td[^>]*>", row)[1] for row in cells]
    assert mse == ["<td>"] * 3                                           # all show 0.5: nothing stands out


def test_render_is_deterministic_without_dates_or_versions():
    fig = F.tensor_figure("t", np.arange(24.0).reshape(1, 4, 6), {"0": np.arange(24.0).reshape(1, 4, 6) * 1.1}, COLORS)
    png, svg = F.render(fig, "png"), F.render(fig, "svg")
    assert png == F.render(fig, "png") and svg == F.render(fig, "svg")
    assert png.startswith(b"\x89PNG") and b"tEXtSoftware\x00quamba-harness report" in png and b"matplotlib" not in png
    assert b"<dc:date>" not in svg and b"Matplotlib v" not in svg and b"<dc:title>quamba-harness report<" in svg


# ---------------------------------------------------------------- reports of files


def _resources(html: str) -> list[str]:
    return re.findall(r"""(?:src|href)\s*=\s*["']([^"']*)["']""", html)


def assert_self_contained(html: str) -> None:
    for url in _resources(html):
        assert url.startswith(("data:image/png;base64,", "#")), url[:60]
    text = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", html)
    assert "http://" not in text and "https://" not in text and "<script" not in text and "<link" not in text
    assert "url(" not in text and "@import" not in text


def test_report_of_a_research_tool_file(tmp_path):
    ref = RNG.standard_normal((1, 16, 8)).astype(np.float32)
    np.savez_compressed(tmp_path / "old.npz", timestamp=np.array("2025-11-10"), model=np.array("quamba-130m-w8a8"),
                        pretrained_dir=np.array("p"), seq_len=np.array(16), mode_fp32_input=ref, mode_fp32_output=ref,
                        **{"mode_2-1_input": ref, "mode_2-1_output": ref * 1.01})
    out = write_report(tmp_path / "old.npz")
    assert out == tmp_path / "old_report.html" and out == report_path(tmp_path / "old.npz")
    html = out.read_text()
    assert_self_contained(html)
    assert "research-tool file" in html and "quamba-130m-w8a8" in html and "2025-11-10" in html
    assert html.count("<img") == 1                     # output differs; input is identical in every mode
    assert "Every mode equals the reference bit for bit in: input" in html
    d = load_report_data(tmp_path / "old.npz")
    assert d.comparison["modes"]["2-1"]["output"]["rel_l2"] == pytest.approx(0.01, rel=1e-4)
    assert "Saturation" not in html and "Error per layer" not in html   # no stats, one layer: no such sections
    # capture --report of a run without its reference mode: a report without the comparison, not an error
    np.savez(tmp_path / "noref.npz", **{"mode_2-1_output": ref, "mode_0_output": ref * 1.01})
    noref = write_report(tmp_path / "noref.npz", reference="fp32", require_reference=False).read_text()
    assert "No comparison: the reference mode fp32" in noref
    with pytest.raises(CompareError, match="reference mode 'fp32' is not in the file; modes present: 2-1, 0"):
        write_report(tmp_path / "noref.npz", reference="fp32")


def _synthetic_file(tmp_path):
    """A file with what 'Where the error comes from' adds: 3 layers, isolated outputs, end-to-end and samples."""
    arrays, ref = {}, {}
    for layer in range(3):
        name = "output" if layer == 0 else f"L{layer}.block.out"
        ref[layer] = RNG.standard_normal((1, 8, 4)).astype(np.float32)
        arrays[f"mode_fp32_{name}" if layer == 0 else f"mode_fp32__{name}"] = ref[layer]
        noise = (0.01 * (layer + 1) * RNG.standard_normal((1, 8, 4))).astype(np.float32)
        arrays[f"mode_0_{name}" if layer == 0 else f"mode_0__{name}"] = ref[layer] + noise
        arrays[f"mode_0__L{layer}.block.isolated"] = ref[layer] + noise / 2
    write_npz(tmp_path / "s.npz", arrays)
    stats = {"schema_version": SCHEMA_VERSION, "model": "synthetic", "modes": {
        "fp32": {"status": "ok", "title": "floating-point reference", "recipe": {"weights": "fp32"}, "tensors": {}},
        "0": {"status": "ok", "title": "baseline", "recipe": {"weights": "int8"}, "tensors": {
            "L1.norm.out": {"quantized": True, "scale": 0.04, "saturated_fraction": 0.001, "clipped_fraction": 0.0005}}},
        "2-4": {"status": "error", "title": "x", "error": "RuntimeError: calibration failed: boom"}},
        "end_to_end": {"fp32": {"kl": 0.0, "top1_agreement": 1.0, "cross_entropy": 2.0, "perplexity": 7.389},
                       "0": {"kl": {"mean": 0.05, "ci95": [0.04, 0.06]}, "top1_agreement": 0.93,
                             "cross_entropy": 2.1, "perplexity": 8.166}},
        "samples": {"count": 4, "metrics": {"0": {"output": {"sqnr_db": {"mean": 31.5, "ci95": [30.1, 32.9],
                                                                          "per_sample": [30, 31, 32, 33]}}}},
                    "pairs": [{"a": "2-4", "b": "0", "tensor": "output", "metric": "sqnr_db", "mean_diff": 3.25,
                               "ci95": [2.5, 4.0]}]},
        "sensitivity": {"0": {"2": {"kl": 0.03, "kl_share": 0.6}, "0": {"kl": 0.01, "kl_share": 0.2}}},
        "future_key": {"ignored": True}}
    write_json(stats_path(tmp_path / "s.npz"), stats)
    return ref, arrays


def test_report_draws_layers_isolated_end_to_end_and_samples_when_present(tmp_path):
    ref, arrays = _synthetic_file(tmp_path)
    d = load_report_data(tmp_path / "s.npz")
    layers, acc, iso = d.layer_sqnr()
    assert layers == [0, 1, 2] and d.failed == {"2-4": "RuntimeError: calibration failed: boom"}
    assert iso["0"][1] == pytest.approx(sqnr_db(ref[1], arrays["mode_0__L1.block.isolated"]))
    assert acc["0"][2] == pytest.approx(sqnr_db(ref[2], arrays["mode_0__L2.block.out"]))
    ranking = d.sensitivity()["0"]
    # issue 21 item 1: where the KL of each layer alone is measured it ranks (most harmful first; layer 1,
    # without it, last), not isolated SQNR (which orders these layers 2, 1, 0)
    assert [r["layer"] for r in ranking] == [2, 0, 1] != sorted(range(3), key=lambda i: iso["0"][i])
    assert {r["layer"]: r["kl_share"] for r in ranking} == {0: 0.2, 1: None, 2: 0.6}
    html, names = build_report(tmp_path / "s.npz")
    assert_self_contained(html)
    assert {"layers_sqnr", "end_to_end", "taps_L1"} <= set(names)
    assert not any(n.startswith("samples") for n in names)       # one mode across samples: its table, no chart
    for text in ("Sensitivity ranking: mode 0 (ranked by the KL of the model with only this layer in the mode, "
                 "most harmful first)", "share of end-to-end KL", "0.05 [0.04, 0.06]", "Failed modes",
                 "calibration failed: boom", "Across samples", "31.5 [30.1, 32.9]", "3.25"):
        assert text in html, text
    # the first screen: worst mode by end-to-end KL, worst layer by KL, the first layer whose SQNR drops 3 dB
    summary = html[html.index('<section id="summary">'):html.index('<section id="run">')]
    assert "<b>Worst mode:</b> 0: end-to-end KL 0.05" in summary
    assert "<b>Worst layer by KL:</b> layer 2 in 0: KL 0.03 with only this layer quantized (60 % of the mode's)" \
        in summary
    assert f"<b>Error first jumps</b> in 0 at layer 0: SQNR inf dB in, {acc['0'][0]:.4g} dB out" in summary


def test_across_samples_charts_only_tensors_where_modes_differ_and_pairs_once_per_group(tmp_path):
    """Issue 21 19: ~36 bar charts, one per tensor and metric, an input SQNR of 70 dB in every mode among them."""
    rng = np.random.default_rng(19)
    x = rng.standard_normal((1, 8, 4)).astype(np.float32)
    y = x + np.float32(0.1) * rng.standard_normal((1, 8, 4)).astype(np.float32)
    arrays = {f"mode_{m}_{t}": a for m in ("fp32", "0", "2-0", "2-4") for t, a in (("input", x), ("output", y))}
    arrays["mode_fp32_output"] = x
    arrays["mode_2-4_output"] = y * np.float32(1.5)
    write_npz(tmp_path / "s.npz", arrays)
    ci = lambda m: {"mean": m, "ci95": [m - 1, m + 1], "per_sample": [m - 1, m + 1]}  # noqa: E731
    metrics = {m: {"input": {"sqnr_db": ci(70.5), "rel_l2": ci(3e-4)}, "output": {"sqnr_db": ci(out), "mse": ci(1.0)}}
               for m, out in (("0", 20.0), ("2-0", 20.0), ("2-4", 15.0))}
    pair = lambda a, b, d: {"a": a, "b": b, "tensor": "output", "metric": "sqnr_db", "mean_diff": d, "ci95": [d, d]}  # noqa: E731
    write_json(stats_path(tmp_path / "s.npz"), {"schema_version": SCHEMA_VERSION, "modes": {}, "samples": {
        "count": 2, "metrics": metrics, "pairs": [pair("0", "2-0", 0.0), pair("0", "2-4", 5.0), pair("2-0", "2-4", 5.0)]}})
    html, names = build_report(tmp_path / "s.npz")
    assert [n for n in names if n.startswith("samples")] == ["samples_sqnr"]     # one chart, SQNR only
    section = html[html.index('<section id="samples">'):]
    section = section[:section.index("</section>")]
    assert "The same mean SQNR in every mode (no chart): input 70.5 [69.5, 71.5] dB." in section
    rows = re.findall(r"<tr><td class=\"l\">([^<]*)</td><td class=\"l\">([^<]*)</td>", section)
    assert rows == [("0 = 2-0", "2-4")]                                           # pairs once per group
    assert "1 pairs of bit-identical modes (difference 0) are left out" in section
    from harness.report.samples import samples_figure

    fig = samples_figure(["output"], {"0 = 2-0": [ci(20.0)], "2-4": [ci(15.0)]}, {"0 = 2-0": "red", "2-4": "blue"}, 2)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["output"] and "over 2 samples" in ax.get_title()
    assert [float(c.lines[0].get_ydata()[0]) for c in ax.containers] == [20.0, 15.0]
    assert samples_figure([], {}, {}) is None


def test_report_of_a_real_run_and_capture_report_flag(hf_dir, tmp_path):
    out = run_modes(hf_dir, tmp_path, ["fp32", "0", "2-4"], layers=[0, 1], taps=["norm.out", "x_proj.in", "ssm.u"],
                    seq_len=32)
    npz = tmp_path / "capture.npz"
    chosen = ["output", "L1.block.out", "L0.x_proj.in"]
    html, names = build_report(npz, tensors=chosen)
    assert_self_contained(html)
    assert html == build_report(npz, tensors=chosen)[0]          # same file, same bytes
    assert {"layers_sqnr", "taps_L0", "taps_L1", "tensor_L1.block.out", "tensor_L0.x_proj.in"} <= set(names)
    assert "tensor_L0.norm.out" not in names and "have no figures here (draw them with --tensors)" in html
    stats = out.stats["modes"]["0"]["tensors"]["L0.norm.out"]
    assert f"{stats['scale']:.4g}" in html                        # the scale table
    assert "Bit-identical modes" in html and "Quamba1 W8A8 baseline" in html
    figs = tmp_path / "figs"
    written = write_report(npz, tmp_path / "r.html", tensors=["output"], figures_dir=figs)
    assert written.is_file()
    assert sorted(p.name for p in figs.iterdir()) == sorted(f"{n}.{e}" for n in ["layers_sqnr", "overflow_per_layer", "taps_L0", "taps_L1",
                                                                                 "tensor_output"] for e in ("png", "svg"))
    (tmp_path / "so").mkdir()
    stats_only = run_modes(hf_dir, tmp_path / "so", ["fp32", "0"], seq_len=32, stats_only=True)
    so_html, _ = build_report(tmp_path / "so" / "capture.npz")
    assert "--stats-only file" in so_html and "<img" not in so_html and "SQNR dB" in so_html
    assert stats_only.stats["stats_only"]


def test_report_command_line_and_bad_input(hf_dir, tmp_path, capsys):
    env = {**os.environ, "QUAMBA_HARNESS_CACHE": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "harness", "capture", "--model", str(hf_dir), "--modes", "fp32", "0",
                        "--seq_len", "32", "--calib_data_num", "8", "--calib_seqlen", "32", "--report", "--quiet"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=600, env=env)
    assert r.returncode == 0, r.stderr
    report = tmp_path / "first_layer_io_all_modes_report.html"
    assert f"wrote report {report.name}" in r.stdout and report.is_file()
    npz = tmp_path / "first_layer_io_all_modes.npz"
    assert main(["report", str(npz), "-o", str(tmp_path / "again.html")]) == 0
    assert (tmp_path / "again.html").read_bytes() == report.read_bytes()
    capsys.readouterr()
    assert main(["report", str(tmp_path / "nothere.npz")]) == 2
    assert "nothere.npz does not exist" in capsys.readouterr().err
    assert main(["report", str(npz), "--reference", "2-4", "-o", str(tmp_path / "x.html")]) == 2
    assert "reference mode '2-4' is not in the file; modes present: fp32, 0" in capsys.readouterr().err
    assert not (tmp_path / "x.html").exists()
    assert main(["report", str(npz), "-o", str(tmp_path / "no" / "r.html")]) == 2
    assert f"directory {tmp_path / 'no'} does not exist" in capsys.readouterr().err


def test_overflow_per_layer_figure_plots_the_largest_fraction_per_layer():
    fig = F.overflow_per_layer_figure([0, 1, 2], {"0": [0.1, None, 0.3]}, {"0": [0.0, 0.2, 0.1]}, COLORS)
    sat, clip = fig.axes
    assert list(sat.lines[0].get_ydata())[::2] == [0.1, 0.3] and np.isnan(sat.lines[0].get_ydata()[1])
    assert list(clip.lines[0].get_ydata()) == [0.0, 0.2, 0.1] and list(sat.get_xticks()) == [0, 1, 2]
    assert F.overflow_per_layer_figure([0], {"0": [0.1]}, {}, COLORS) is None


def test_auto_selection_of_a_big_file_keeps_first_layer_and_worst_layers(tmp_path):
    from harness.report.sections import focus_layers, select_tensors

    arrays, noise = {}, {5: 0.5, 9: 0.3}          # layers 5 and 9 are the worst
    for layer in range(12):
        for point in ("block.out", "norm.out", "ssm.u", "block.residual"):
            name = {"block.out": "output", "block.residual": "residual"}.get(point) if layer == 0 else None
            name = name or f"L{layer}.{point}"
            ref = RNG.standard_normal((1, 4, 3)).astype(np.float32)
            key = (lambda m: f"mode_{m}_{name}" if "." not in name else f"mode_{m}__{name}")
            arrays[key("fp32")] = ref
            arrays[key("0")] = ref + np.float32(noise.get(layer, 0.01 + 0.001 * layer)) * RNG.standard_normal(
                (1, 4, 3)).astype(np.float32)
    write_npz(tmp_path / "big.npz", arrays)
    d = load_report_data(tmp_path / "big.npz")
    assert len(d.tensors()) == 48 > 40
    focus = focus_layers(d)
    assert {0, 11, 5, 9} <= set(focus) and len(focus) == 8
    chosen = select_tensors(d, None)
    assert [t for t in chosen if t in ("output", "residual") or t.startswith("L0.")] == \
        [t for t in d.tensors() if t in ("output", "residual") or t.startswith("L0.")]     # all of the first layer
    assert "L5.block.out" in chosen and "L5.norm.out" not in chosen
    assert {t for t in chosen if t.endswith("block.out")} == {f"L{i}.block.out" for i in focus if i}
    assert select_tensors(d, ["all"]) == d.tensors() and select_tensors(d, ["L3.ssm.u"]) == ["L3.ssm.u"]


def test_number_format_histogram_ticks_are_plain_text_not_raw_mathtext():
    """Issue "What trying it found" 17: the symlog count axis kept matplotlib's mathtext labels
    ($\\mathdefault{10^{3}}$), drawn raw because the report turns math parsing off."""
    import torch

    from harness.report.format_section import _histogram_figure

    with F.style():
        fig = _histogram_figure("t", torch.linspace(-300.0, 300.0, 4001) ** 3 / 9e4, ["int8", "fp8_e4m3"])
        fig.canvas.draw()
        labels = [t.get_text() for ax in fig.axes for t in ax.get_yticklabels() + ax.get_xticklabels()]
    assert labels and not any("$" in s or "mathdefault" in s for s in labels), labels
    assert {"1", "10", "100"} <= set(labels)


def test_the_comparison_table_wraps_its_headers_in_small_type_to_fit_1280_px():
    """Issue "What trying it found" 17: the 15-column table needed horizontal scrolling at 1280 px
    ("input differs" last): its headers now wrap and its type is smaller."""
    from harness.report.html import comparison_table, page

    rows = {m: {"mse": 1e-4, "sqnr_db": 30.0, "input_differs": True} for m in ("fp32", "2-4")}
    html = comparison_table("L0.out", rows, "fp32", {"2-4": "Quamba2 W8A8 with a long title"})
    assert html.startswith('<table class="metrics"><thead>') and "<th>input differs</th>" in html
    css = page("t", "", [], [])
    assert "table.metrics th{white-space:normal" in css and "table.metrics{font-size:11.5px}" in css
    assert "table.metrics td.l{white-space:normal" in css


def test_bit_identical_modes_come_with_a_note_that_insides_can_differ():
    """Issue "What trying it found" 19: "0 = 2-1 = 2-2" was printed with no word on why (their scans differ by
    an fp16 ulp at ssm.out that the int8 had.out absorbs)."""
    from harness.report.text import IDENTICAL_NOTE, identical_text

    line = identical_text({"identical_groups": [["0", "2-1", "2-2"]]})
    assert "0 = 2-1 = 2-2\n  note: equal in the tensors captured only" in line
    assert "--taps all" in line and "ssm.out" in line and "docs/modes.md" in line
    assert "note" not in identical_text({"identical_groups": []})
    from pathlib import Path
    assert "### Equal outputs" in (Path(__file__).parents[2] / "docs" / "modes.md").read_text()
    assert "internal taps differ" in IDENTICAL_NOTE
