"""Where the report may write: never over its capture, the capture's stats or pending stats, a link, a special
file, or any existing file the report did not write itself.

The report's own files carry a mark (``html.MARK``): the page has ``<meta name="generator"
content="quamba-harness report">`` in its head, a PNG figure that text as its Software chunk, an SVG figure
as its creator. An existing file is replaced only when its first 4 KiB begin as such a file and hold the mark
(a page written before the mark existed is recognised by its title). This module imports no matplotlib, so
a capture can check its ``--report`` path before any work.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..store.files import StorageError, check_output, open_regular, same_file
from ..store.format import pending_path, stats_path
from .html import GENERATOR, MARK

__all__ = ["report_path", "written_by_report", "check_target"]

_HEAD = 4096
_OWN = ((b"<!DOCTYPE html>", GENERATOR.encode()), (b"<!DOCTYPE html>", b"<title>Quamba harness report: "),
        (b"\x89PNG\r\n\x1a\n", b"tEXtSoftware\x00" + MARK.encode()),
        (b"<?xml", f"<dc:title>{MARK}</dc:title>".encode()))


def report_path(npz_path: Path) -> Path:
    """first_layer_io_all_modes.npz -> first_layer_io_all_modes_report.html (same folder)."""
    npz_path = Path(npz_path)
    stem = npz_path.name[:-4] if npz_path.name.endswith(".npz") else npz_path.name
    return npz_path.with_name(f"{stem}_report.html")


def written_by_report(path: Path) -> bool:
    """Whether the regular file at `path` is a report page or figure file that the report wrote."""
    try:
        with open_regular(path) as f:
            head = f.read(_HEAD)
    except (OSError, StorageError):
        return False
    return any(head.startswith(start) and mark in head for start, mark in _OWN)


def check_target(path: Path, capture: Path, others: dict[str, Path] | None = None) -> None:
    """Refuse to write the report page or a figure file at `path` (StorageError) unless nothing is there or
    the report wrote what is there. others: more paths it must not be, by what they are."""
    path, capture = Path(path), Path(capture)
    check_output(path)  # a directory, a device, a FIFO, a socket
    keep = {"the capture file": capture, "the capture's stats file": stats_path(capture),
            "the capture's pending stats file": pending_path(capture), **(others or {})}
    for what, other in keep.items():
        if same_file(path, other):
            raise StorageError(f"cannot write {path}: it is {what} of this report ({other}); the report never "
                               f"writes over its input: choose another path (default: {report_path(capture).name})")
    if os.path.islink(path):
        raise StorageError(f"cannot write {path}: it is a symbolic link; the report never replaces links, "
                           f"choose another path")
    if os.path.lexists(path) and not written_by_report(path):
        raise StorageError(f"cannot write {path}: it exists and is not a file the report wrote (the report's "
                           f"pages and figures carry '{MARK}'), so it is left alone: choose another path, or "
                           f"move it away")
