"""`python -m harness report FILE.npz [-o OUT.html] [--figures DIR] [--against B.npz]`: the one-file HTML report.

    from harness.report.build import write_report
    write_report(Path("first_layer_io_all_modes.npz"))   # -> first_layer_io_all_modes_report.html
    # with the cross-run section (runner.crossrun.compare_files's dict):
    write_report(Path("A.npz"), crossrun=compare_files(Path("A.npz"), Path("B.npz")))
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

from matplotlib.figure import Figure

from ..metrics.compare import CompareError
from ..store.files import atomic_write
from ..store.format import StorageError, check_writable
from .figures import mode_colors, render, style
from .format_section import DEFAULT_REPORT_FORMATS, format_section
from ..kernels.formats import FORMATS
from ..plugins import PluginError, load_all
from .target import check_target, report_path
from .data import load_report_data
from .crossrun import crossrun_section
from .decoding import decode_section, generate_section
from .eval import eval_report, is_eval_file
from .html import esc, page
from .samples import samples_section
from .q2_section import q2_section
from .segments import se_segment_section
from .field_section import recipe_html
from .summary import summary_section
from .sections import (
    Figures,
    comparison_section,
    end_to_end_section,
    header_section,
    layers_section,
    select_tensors,
    taps_section,
    tensor_section,
)

__all__ = ["report_path", "build_report", "write_report", "build_report_parser", "report_main"]


def _atomic_write(path: Path, data: bytes) -> None:
    """The pair's way (store.files.atomic_write): a temporary file next to `path` created with the umask's
    permissions (0666 & ~umask), fsynced, renamed into place; removed if anything fails."""
    atomic_write(path, lambda f: f.write(data))


def _figure_sink(files: dict[str, bytes]):
    def keep(slug: str, fig: Figure) -> None:
        for fmt in ("png", "svg"):
            files[f"{slug}.{fmt}"] = render(fig, fmt)
    return keep


def build_report(npz_path: Path, reference: str | None = None, tensors: list[str] | None = None,
                 figure_files: dict[str, bytes] | None = None, require_reference: bool = True,
                 formats: list[str] | None = None, *, crossrun: dict | None = None) -> tuple[str, list[str]]:
    """(HTML text, figure names) of the report of one capture file; figure_files (when given) receives every
    figure as NAME.png and NAME.svg -> bytes; crossrun: a cross-run comparison of this file against another
    (runner.crossrun.compare_files's dict) for the Across runs section. Nothing is written."""
    d = load_report_data(npz_path, reference, require_reference)
    figs = Figures(_figure_sink(figure_files) if figure_files is not None else None)
    colors = mode_colors(list(dict.fromkeys([d.reference, *d.modes])))
    chosen = select_tensors(d, tensors) if d.has_arrays() else []
    sections = [
        ("summary", "Summary", summary_section(d)),
        ("run", "Run", header_section(d)),
        ("comparison", "Comparison", comparison_section(d)),
        ("recipes", "Recipes side by side", recipe_html(d.comparison, d.stats, d.reference)),
        ("layers", "Error per layer", layers_section(d, figs, colors)),
        ("end-to-end", "End to end", end_to_end_section(d, figs, colors)),
        ("samples", "Across samples", samples_section(d, figs, colors)),
        ("decode", "Decode steps", decode_section(d)),
        ("generate", "Generation", generate_section(d)),
        ("crossrun", "Across runs", crossrun_section(crossrun)),
        ("taps", "Saturation and scales", taps_section(d, figs, colors)),
        ("q2-groups", "Quamba2 x groups", q2_section(d, figs)),
        ("se-segments", "Quamba-SE segments", se_segment_section(d.stats)),
        ("tensors", "Per tensor", tensor_section(d, figs, colors, chosen)),
        ("formats", "Number formats", format_section(d, figs, formats, chosen) if formats else ""),
    ]
    sections = [s for s in sections if s[2]]
    model = d.stats.get("model") or (str(d.capture.npz["model"]) if "model" in d.capture.npz.files else "")
    modes = ", ".join(d.modes)
    subtitle = (f"{esc(d.path.name)}: model {esc(model or '?')}, modes {esc(modes)}, against {esc(d.reference)}"
                + (" (--stats-only file: no arrays, tables and statistics only)" if d.stats.get("stats_only") else ""))
    text = page(f"Quamba harness report: {d.path.name}", subtitle, [(a, t) for a, t, _ in sections],
                [s for _, _, s in sections])
    return text, figs.names


def write_report(npz_path: Path, out: Path | None = None, reference: str | None = None,
                 tensors: list[str] | None = None, figures_dir: Path | None = None,
                 require_reference: bool = True, formats: list[str] | None = None,
                 *, crossrun: dict | None = None) -> Path:
    """Write the report next to the .npz (or to `out`), atomically; returns its path.

    No file is written over the capture, its stats or pending stats, or a file the report did not write
    (report.target): the page's path is checked first, the figure files' once they are drawn, and only
    then is anything written (the figures, then the page).
    """
    out = Path(out) if out is not None else report_path(npz_path)
    check_writable(out)
    against = {"the --against file": Path(crossrun["b"])} if crossrun and crossrun.get("b") else {}
    check_target(out, npz_path, against)
    files: dict[str, bytes] | None = None
    if figures_dir is not None:
        figures_dir, files = Path(figures_dir), {}
        if figures_dir.exists() and not figures_dir.is_dir():
            raise StorageError(f"--figures {figures_dir} exists and is not a directory")
    with style():
        text, _ = build_report(npz_path, reference, tensors, files, require_reference, formats, crossrun=crossrun)
    for name in files or {}:
        check_target(figures_dir / name, npz_path, {"the report page": out, **against})
    if figures_dir is not None:
        figures_dir.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            _atomic_write(figures_dir / name, data)
    _atomic_write(out, text.encode("utf-8"))
    return out


def build_report_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Write one self-contained HTML report (tables and figures) "
                                "of a capture file: ours (any schema, --stats-only too) or the research tool's.")
    p.add_argument("file", type=Path, help="capture .npz, or an eval file NAME_eval.json (python -m harness eval: "
                   "its accuracy tables and paired differences, printed and written as NAME_eval.html)")
    p.add_argument("-o", "--output", type=Path, default=None, help="HTML file (default: FILE_report.html next to FILE)")
    p.add_argument("--figures", type=Path, default=None, metavar="DIR", help="also write every figure as PNG and SVG to DIR")
    p.add_argument("--reference", default=None, help="reference mode (default: the file's, else fp32)")
    p.add_argument("--tensors", nargs="+", default=None, metavar="T",
                   help="tensors that get per-tensor figures: names, 'all', or 'auto' (default: all when there are "
                        "at most 40, else every tensor of the first layer and the block outputs of the first, the last and the 6 layers of lowest SQNR)")
    p.add_argument("--formats", nargs="*", default=None, metavar="F", choices=list(FORMATS),
                   help="add the Number formats section: the tensors in these formats (no value: "
                        + " ".join(DEFAULT_REPORT_FORMATS) + ")")
    p.add_argument("--against", type=Path, default=None, metavar="B.npz",
                   help="add the Across runs section: the same modes of B.npz, its first differing tensor per mode "
                        "(as compare FILE --against B.npz)")
    p.add_argument("--atol", type=float, default=0.0, help="with --against: absolute tolerance (default 0)")
    p.add_argument("--rtol", type=float, default=0.0, help="with --against: relative tolerance (default 0)")
    p.add_argument("--plugin", action="append", default=[], metavar="FILE_OR_MODULE",
                   help="load a plugin first: a .py file or a dotted module name (repeatable; docs/plugins.md)")
    return p


# compare(a, b, atol, rtol) -> runner.crossrun.compare_files's dict; raises ValueError (CrossRunError) or
# StorageError on files that cannot be compared. The command line passes it in (the runner ranks above).
CrossRunFn = Callable[[Path, Path, float, float], dict]


def report_main(argv: list[str] | None = None, prog: str | None = None, compare: CrossRunFn | None = None) -> int:
    args = build_report_parser(prog).parse_args(argv)
    try:
        load_all(args.plugin)
        formats = None if args.formats is None else (args.formats or list(DEFAULT_REPORT_FORMATS))
        if is_eval_file(args.file):
            text, out = eval_report(args.file, args.output)
            print(text)
            print(f"\nwrote report {out}")
            return 0
        crossrun = None
        if args.against is not None:
            if compare is None:
                raise StorageError("--against needs the cross-run comparison: run python -m harness report")
            crossrun = compare(args.file, args.against, args.atol, args.rtol)
        out = write_report(args.file, args.output, args.reference, args.tensors, args.figures, formats=formats,
                           crossrun=crossrun)
    except (StorageError, CompareError, PluginError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote report {out}" + (f" and figures in {args.figures}" if args.figures else ""))
    return 0
