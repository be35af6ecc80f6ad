"""`python -m harness formats [FILE.npz] [--formats ...] [--modes ...] [--tensors ...] [--json PATH]`.

Without a file: the number formats (block size, element type, scale rule, bits per value). With a capture
(this harness's or the research tool's, read through harness.store): for every captured tensor of the chosen
modes, the error of representing it in each format (harness.metrics.formats), as a table and in JSON.

    from harness.report.formats import sweep_file
    result = sweep_file(Path("first_layer_io_all_modes.npz"), formats=["hifp8", "mxfp8_e4m3", "bf16"])
    result["modes"]["fp32"]["output"]["hifp8"]["sqnr_db"]
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
from tabulate import tabulate

from ..kernels.formats import FORMATS
from ..metrics.formats import FORMAT_METRICS, empty_tensor, format_errors, not_applicable, reference
from ..store.format import StorageError
from ..store.reader import load_capture

__all__ = ["SweepError", "format_table", "sweep_file", "sweep_tables"]


class SweepError(ValueError):
    """A --formats, --modes or --tensors value matches nothing; the message lists what is valid."""


def format_table() -> str:
    rows = [[f.name, f.block or "-", f.element, f.scale, f.bits] for f in FORMATS.values()]
    return tabulate(rows, headers=["format", "block", "element", "scale", "bits/value"])


def _check_known(what: str, asked: list[str] | None, present: list[str], where: str) -> None:
    unknown = [a for a in asked or [] if a not in present]
    if unknown:
        raise SweepError(f"{what} {' '.join(unknown)} matches nothing{where}; valid: {', '.join(present) or 'none'}")


def sweep_file(path: Path, formats: list[str] | None = None, modes: list[str] | None = None,
               tensors: list[str] | None = None) -> dict:
    """{"file", "formats", "modes": {mode: {tensor: {format: metrics | {"not_applicable": why}}}}} of a capture.

    Arrays that are not floating point (token ids) are left out; an empty array (a dimension of size 0) is
    not applicable in every format, the reason saying it is empty. StorageError for an unreadable file,
    SweepError for a name that matches nothing, or, when both formats and tensors are named, for a tensor
    whose last dimension is not a multiple of a named format's block (otherwise that row says why)."""
    explicit = formats is not None and tensors is not None
    formats = list(formats or FORMATS)
    _check_known("--formats", formats, list(FORMATS), "")
    cf = load_capture(path)
    if (cf.manifest or {}).get("stats_only"):
        raise StorageError(f"{path} was written with --stats-only and holds no arrays to sweep")
    _check_known("--modes", modes, cf.modes(), f" in {path}")
    _check_known("--tensors", tensors, sorted({t for m in cf.modes() for t in cf.tensors(m)}), f" in {path}")
    out: dict = {"file": str(path), "formats": formats, "modes": {}}
    for mode in cf.modes():
        if modes is not None and mode not in modes:
            continue
        for tensor in cf.tensors(mode):
            if tensors is not None and tensor not in tensors:
                continue
            arr = cf.array(mode, tensor)
            if arr.dtype.kind != "f":
                continue
            if (empty := empty_tensor(arr.shape)) is not None:  # a row that says so, in every format
                out["modes"].setdefault(mode, {})[tensor] = {fmt: {"not_applicable": empty} for fmt in formats}
                continue
            x = torch.from_numpy(arr.astype("float32", copy=False))
            row, ref = {}, reference(x)  # what the metrics need of x alone, once for every format
            for fmt in formats:
                why = not_applicable(tuple(x.shape), fmt)
                if why and explicit:  # a pair the user named that cannot be represented: bad input
                    raise SweepError(f"{mode} {tensor} {list(x.shape)}: {why}")
                row[fmt] = {"not_applicable": why} if why else format_errors(x, fmt, ref)
            out["modes"].setdefault(mode, {})[tensor] = row
    return out


def _cell(metric: str, v: float | None) -> str:
    if v is None:
        return "-"
    if metric in ("overflow", "underflow", "saturated", "outlier_blocks"):
        return f"{100 * v:.2f}%"
    if math.isnan(v) or math.isinf(v):
        return str(v)
    return f"{v:.2f}" if metric == "sqnr_db" else f"{v:.4g}"


def sweep_tables(result: dict) -> str:
    """One table per mode: a row per tensor and format."""
    parts = []
    for mode, rows in result["modes"].items():
        table, notes = [], {}
        for tensor, per_fmt in rows.items():
            empty = next(iter(per_fmt.values()), {}).get("not_applicable", "")
            if empty.startswith("the tensor is empty"):  # one row: no format has anything to represent
                table.append([tensor, "all", *["empty"] * len(FORMAT_METRICS)])
                notes[f"{tensor}: {empty}"] = None
                continue
            for fmt, m in per_fmt.items():
                if "not_applicable" in m:
                    table.append([tensor, fmt, *["n/a"] * len(FORMAT_METRICS)])
                    notes.setdefault(fmt, FORMATS[fmt].block)
                else:
                    table.append([tensor, fmt, *(_cell(k, m[k]) for k in FORMAT_METRICS)])
        parts.append(f"mode {mode}\n" + tabulate(table, headers=["tensor", "format", *FORMAT_METRICS],
                                                 disable_numparse=True)
                     + "".join(f"\nn/a: {f} needs a last dimension that is a multiple of {b}" if b else f"\n{f}"
                               for f, b in notes.items()))
    return "\n\n".join(parts) if parts else "no floating-point tensors matched"
