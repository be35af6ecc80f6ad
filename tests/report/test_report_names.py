"""Names from a file (modes, tensors) are shown as text in the report (issue 21 item 15): mathtext ($...$)
never reaches matplotlib's parser, markup (<b>) is escaped in the HTML."""
import numpy as np
from matplotlib.figure import Figure

from harness.report import figures as F
from harness.report.build import write_report

MATH, BROKEN, MARKUP = "$x^2$", "$\\frac{$", "<b>"


def test_mode_names_with_mathtext_and_markup_are_shown_as_text(tmp_path):
    """A broken mathtext name ended the report in a ValueError from the mathtext parser; a name with $...$
    was drawn as a formula."""
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((1, 16, 8)).astype(np.float32)
    arrays = {"mode_fp32_output": ref, f"mode_{MATH}_output": ref * 1.01, f"mode_{BROKEN}_output": ref * 0.98,
              f"mode_{MARKUP}_output": ref + 0.01}
    np.savez(tmp_path / "names.npz", **arrays)
    html = write_report(tmp_path / "names.npz").read_text()
    assert f"modes fp32, {MATH}, {BROKEN}, &lt;b&gt;, against fp32" in html
    assert "<b>," not in html and "<b> (" not in html and html.count("<img") == 1


def test_figure_text_is_never_parsed_as_math():
    with F.style():
        fig = Figure()
        ax = fig.add_subplot()
        d = np.linspace(-1, 1, 50)
        assert F.error_histogram(ax, {MATH: d, BROKEN: d * 2}, F.mode_colors([MATH, BROKEN]))
        ax.legend()
        ax.set_title(MATH)
        png = F.render(fig)
    texts = [t for t in fig.findobj(lambda a: hasattr(a, "_preprocess_math")) if t.get_text() in (MATH, BROKEN)]
    assert len(texts) == 3 and all(t._preprocess_math(t.get_text()) == (t.get_text(), False) for t in texts)
    assert png.startswith(b"\x89PNG")
