"""HTML of the report: one page, inline CSS, images as base64 data URIs, no script, no network resource."""
from __future__ import annotations

import base64
import html
import math
from typing import Iterable, Sequence

__all__ = ["esc", "table", "image", "section", "page", "fmt_value", "comparison_table", "WORSE_IS_HIGHER",
           "WORSE_IS_LOWER", "facts", "MARK", "GENERATOR"]

# The mark of the files the report writes (report.target replaces no other file): the page's generator
# meta tag, a PNG figure's Software text chunk, an SVG figure's creator.
MARK = "quamba-harness report"
GENERATOR = f'<meta name="generator" content="{MARK}">'

# Metric columns of the comparison table and which direction is worse.
WORSE_IS_HIGHER = ("mse", "mae", "rmse", "max_abs", "rel_l2", "p50", "p90", "p99")
WORSE_IS_LOWER = ("sqnr_db", "cosine", "pearson")
_COLUMNS = (("mse", "MSE"), ("mae", "MAE"), ("rmse", "RMSE"), ("max_abs", "max|err|"), ("max_abs_index", "at"),
            ("rel_l2", "rel L2"), ("sqnr_db", "SQNR dB"), ("cosine", "cosine"), ("pearson", "Pearson"),
            ("p50", "p50 |err|"), ("p90", "p90 |err|"), ("p99", "p99 |err|"), ("input_differs", "input differs"),
            ("identical", "identical"))

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;margin:0 auto;
max-width:1280px;padding:0 16px 48px;color:#222;line-height:1.4;font-size:14px}
h1{font-size:22px;margin:18px 0 6px}h2{font-size:18px;border-bottom:1px solid #ccc;padding-bottom:3px;margin-top:28px}
h3{font-size:15px;margin:18px 0 6px}
table{border-collapse:collapse;margin:6px 0 12px;font-size:12.5px;display:block;overflow-x:auto;max-width:100%}
th,td{border:1px solid #ddd;padding:3px 7px;text-align:right;white-space:nowrap}
th{background:#f3f3f3}td.l,th.l{text-align:left}
table.metrics{font-size:11.5px}table.metrics th,table.metrics td{padding:2px 4px}
table.metrics th{white-space:normal;vertical-align:bottom}table.metrics td.l{white-space:normal;min-width:8em}
td.worst{background:#ffd7d2;font-weight:600}tr.ref td{color:#666}
figure{margin:8px 0 18px}figure img{max-width:100%;height:auto;border:1px solid #eee}
figcaption{font-size:12.5px;color:#444;margin-top:3px}
.note{color:#555;font-size:13px}.bad{color:#b00020}
details>summary{cursor:pointer;font-weight:600;margin:6px 0}
nav a{margin-right:12px}
"""


def esc(value) -> str:
    return html.escape(str(value), quote=True)


def fmt_value(value) -> str:
    """Numbers to 4 significant digits, inf/nan spelled out, booleans as yes/no."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(map(str, value)) + ")"
    return str(value)


def table(headers: Sequence[str], rows: Iterable[Sequence], left: int = 1, classes: Sequence[Sequence[str]] | None = None,
          row_classes: Sequence[str] | None = None, css_class: str = "") -> str:
    """An HTML table; the first `left` columns are left-aligned; cells are escaped (pass str for pre-made text);
    `css_class` names the table's class."""
    head = "".join(f'<th class="l">{esc(h)}</th>' if i < left else f"<th>{esc(h)}</th>" for i, h in enumerate(headers))
    head = f"<thead><tr>{head}</tr></thead>" if any(headers) else ""
    body = []
    for r, row in enumerate(rows):
        cells = []
        for i, cell in enumerate(row):
            cls = ["l"] if i < left else []
            if classes and classes[r][i]:
                cls.append(classes[r][i])
            attr = f' class="{" ".join(cls)}"' if cls else ""
            cells.append(f"<td{attr}>{esc(fmt_value(cell))}</td>")
        rc = f' class="{row_classes[r]}"' if row_classes and row_classes[r] else ""
        body.append(f"<tr{rc}>{''.join(cells)}</tr>")
    attr = f' class="{esc(css_class)}"' if css_class else ""
    return f"<table{attr}>{head}<tbody>{''.join(body)}</tbody></table>"


def facts(pairs: Iterable[tuple[str, object]]) -> str:
    """A two-column table of labelled facts; empty values are left out."""
    rows = [(k, v) for k, v in pairs if v not in (None, "", [], {})]
    return table(("", ""), rows, left=2) if rows else ""


def image(png: bytes, alt: str, caption: str = "", anchor: str = "") -> str:
    data = base64.b64encode(png).decode("ascii")
    ident = f' id="{esc(anchor)}"' if anchor else ""
    cap = f"<figcaption>{caption}</figcaption>" if caption else ""
    return f'<figure{ident}><img alt="{esc(alt)}" src="data:image/png;base64,{data}">{cap}</figure>'


def section(title: str, body: str, anchor: str, note: str = "") -> str:
    text = f'<p class="note">{note}</p>' if note else ""
    return f'<section id="{esc(anchor)}"><h2>{esc(title)}</h2>{text}{body}</section>'


def _worst(values: list[float | None], higher: bool) -> str | None:
    """The worst value as the table shows it (4 significant digits), None when every value shows the same:
    rows that show equal values are highlighted alike, and none when nothing stands out."""
    finite = [v for v in values if isinstance(v, float) and not math.isnan(v)]
    if len(finite) < 2 or len({fmt_value(v) for v in finite}) == 1:
        return None
    return fmt_value(max(finite) if higher else min(finite))


def comparison_table(tensor: str, rows: dict[str, dict], reference: str, titles: dict[str, str]) -> str:
    """Every metric of every mode for one tensor; the worst value of each metric column is highlighted."""
    modes = list(rows)
    worst = {}
    for key in WORSE_IS_HIGHER + WORSE_IS_LOWER:
        vals = [rows[m].get(key) if isinstance(rows[m].get(key), float) else None for m in modes]
        worst[key] = _worst(vals, key in WORSE_IS_HIGHER)
    body, classes = [], []
    for mode in modes:
        row = rows[mode]
        label = f"{mode} ({titles[mode]})" if titles.get(mode) else mode
        body.append([label] + [row.get(k) for k, _ in _COLUMNS])
        classes.append([""] + ["worst" if worst.get(k) is not None and isinstance(row.get(k), float)
                               and fmt_value(row[k]) == worst[k] else "" for k, _ in _COLUMNS])
    headers = [f"mode vs {reference}"] + [h for _, h in _COLUMNS]
    # 15 columns: smaller type and headers that wrap ("input differs" on two lines) fit 1280 px without scrolling
    return table(headers, body, classes=classes, css_class="metrics")


def page(title: str, subtitle: str, nav: Sequence[tuple[str, str]], sections: Sequence[str]) -> str:
    links = "".join(f'<a href="#{esc(a)}">{esc(t)}</a>' for a, t in nav)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">" + GENERATOR +
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{esc(title)}</title><style>{_CSS}</style></head><body>"
            f"<h1>{esc(title)}</h1><p class=\"note\">{subtitle}</p><nav>{links}</nav>"
            + "".join(sections) + "</body></html>\n")
