"""Command lines: capture (save_first_layer_io.py), compare (compare_with_fp.py), export, report, modes, points, formats.

Exit codes: 0 success; 1 a mode failed (capture) or --fail-if matched (compare);
2 usage or input errors (argparse, unknown mode, missing model directory, ...);
130 / 143 interrupted by SIGINT / SIGTERM (one line says what was kept, no traceback).
Every option is accepted with underscores and with dashes (--seq_len, --seq-len).
"""
from __future__ import annotations

from .capture import build_capture_parser, capture_main
from .compare import build_compare_parser, compare_main
from .export import build_export_parser, export_main
from .main import main, preload, report_main

__all__ = ["main", "preload", "capture_main", "compare_main", "export_main", "report_main", "build_capture_parser",
           "build_compare_parser", "build_export_parser"]
