"""`export`: calibrate a float model and write a Quamba1 W8A8 checkpoint."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .guard import guarded
from .options import add_calibration_options, add_plugin_option, opt, plugins_loaded

__all__ = ["build_export_parser", "export_main"]


def build_export_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Calibrate every layer of a float Mamba model and write a "
                                "Quamba1 W8A8 checkpoint (a Mamba-2 model: Quamba2 W8A8) (config.json, pytorch_model.bin, "
                                "tokenizer) as Quamba's save_pretrained does.")
    opt(p, "model", type=Path, required=True, help="the float model directory (transformers or mamba_ssm layout)")
    opt(p, "output_dir", type=Path, required=True, help="new (or empty) directory to write")
    opt(p, "tokenizer", type=Path, default=None, help="directory with tokenizer.json (default: the model directory)")
    opt(p, "quantize_embedding", action="store_true",
         help="store the embedding as W8O16Embedding (Quamba's --quantize_embedding); default: fp16, as Quamba1")
    opt(p, "quantize_lm_head", action="store_true",
         help="store lm_head as W8A8B16O16Linear and norm_f with its output scale (Quamba's --quantize_lm_head; "
              "one more calibration pass through every layer); default: fp16, as Quamba1")
    opt(p, "recipe", default="w8a8", metavar="RECIPE",
        help="Quamba's recipe (a Mamba-2 model: Quamba2's w8a8, w4a8 or w4a16; a Mamba-1 model: Quamba1's w8a8, "
             "Quamba2's w4a8 or w4a16), or the name of a plugin's exporter (docs/plugins.md)")
    g = p.add_argument_group("calibration (as for capture; the calibration cache is shared)")
    add_calibration_options(g)
    opt(p, "quiet", action="store_true", help="print only errors and the output directory")
    add_plugin_option(p)
    return p


def export_main(argv: list[str] | None = None, prog: str | None = None) -> int:
    return guarded(_export, argv, prog)


def _export(argv: list[str] | None, prog: str | None, progress) -> int:
    args = build_export_parser(prog).parse_args(argv)
    if not plugins_loaded(args.plugin):
        return 2
    from ..runner.calibration import CalibrationSettings, default_cache_dir
    from ..runner.export import INPUT_ERRORS, ExportConfig, export, exporter_names

    valid = exporter_names()
    if args.recipe not in valid:  # before any file is read (an exporter for another architecture: export says)
        print(f"error: --recipe {args.recipe}: valid: {', '.join(valid)}", file=sys.stderr)
        return 2

    cfg = ExportConfig(model=args.model, output_dir=args.output_dir, tokenizer=args.tokenizer,
                       calib=CalibrationSettings(args.calib_data_num, args.calib_seqlen, args.percentile_alpha,
                                                 args.calib_batch_size, args.seed),
                       calib_file=args.calib_file,
                       cache_dir=None if args.no_cache else (args.cache_dir or default_cache_dir()),
                       quantize_embedding=args.quantize_embedding, quantize_lm_head=args.quantize_lm_head,
                       recipe=args.recipe)
    try:
        export(cfg, emit=(lambda _s: None) if args.quiet else print, progress=progress.silenced(args.quiet))
    except INPUT_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.quiet:
        print(args.output_dir)
    return 0
