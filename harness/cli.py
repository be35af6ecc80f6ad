"""Command lines: capture (save_first_layer_io.py), compare (compare_with_fp.py), export, modes, points, formats.

Exit codes: 0 success; 1 a mode failed (capture) or --fail-if matched (compare);
2 usage or input errors (argparse, unknown mode, missing model directory, ...);
130 / 143 interrupted by SIGINT / SIGTERM (one line says what was kept, no traceback).
Every option is accepted with underscores and with dashes (--seq_len, --seq-len).
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

__all__ = ["main", "capture_main", "compare_main", "export_main", "build_capture_parser", "build_compare_parser",
           "build_export_parser"]


def _checked(convert, ok, expected: str):
    """An argparse type: convert the text, then require ok(value); errors say what was expected."""
    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {expected}, got {value}")
        return value
    return parse


MAX_COUNT = 10**9  # tokens, samples, batch: far beyond any run, small enough to never overflow


def _int(text: str) -> int:
    text = text.strip()
    if len(text) > 30:
        raise ValueError(text)
    return int(text)


_count = _checked(_int, lambda v: v > 0, "a positive integer")


def _positive_int(text: str) -> int:
    value = _count(text)
    if value > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"must be a positive integer of at most {MAX_COUNT}, got {value}")
    return value


_alpha = _checked(float, lambda v: 0.0 < v <= 1.0, "in (0, 1]")
def _layer(text: str) -> str:
    """One --layers item: all, a block index, -1 (the last; -2 the one before), or a range A-B."""
    from .emulation.capture import LAYER_SPEC_RE

    text = text.strip()
    if len(text) > 30 or not LAYER_SPEC_RE.match(text):
        raise argparse.ArgumentTypeError(f"must be all, a block index (0, 1, ...), -1 for the last, or a range "
                                         f"such as 0-5, got {text!r}")
    return text
_seed = _checked(_int, lambda v: 0 <= v < 2**63, "an integer in 0..2^63-1")


def _opt(parser: argparse.ArgumentParser, name: str, **kwargs) -> None:
    """Add --a_b together with --a-b (and the reverse), one destination."""
    flags = [f"--{name}"]
    for other in (name.replace("_", "-"), name.replace("-", "_")):
        if f"--{other}" not in flags:
            flags.append(f"--{other}")
    parser.add_argument(*flags, dest=name.replace("-", "_"), **kwargs)


def _add_model_options(p: argparse.ArgumentParser) -> None:
    from .runner.pipeline import DEFAULT_MODEL

    g = p.add_argument_group("model")
    _opt(g, "model", default=None, help=f"model directory (default: the shipped {DEFAULT_MODEL.name}); "
                                        "with --pretrained_dir, a name inside it")
    _opt(g, "pretrained_dir", type=Path, default=None, help="directory holding models: the model is PRETRAINED_DIR/MODEL")
    _opt(g, "tokenizer", type=Path, default=None, help="directory with tokenizer.json (default: the model directory)")
    _opt(g, "mamba_model_path", type=Path, default=None,
         help="the float model of a quantized Quamba --model (DIR or DIR/mamba-<size>): modes fp32 and 1 "
              "run from it and the pair is checked; ignored with a float --model")


def _add_mode_options(p: argparse.ArgumentParser) -> None:
    from .modes import BUILTIN_MODES, PRESETS

    g = p.add_argument_group("modes")
    _opt(g, "modes", nargs="+", default=["all"], metavar="MODE",
         help=f"modes or presets (default: all). Modes: {', '.join(BUILTIN_MODES)}; presets: "
              + "; ".join(f"{k} = {' '.join(v)}" for k, v in PRESETS.items()))
    _opt(g, "modes_file", type=Path, default=None, help="JSON or TOML file of user-defined modes (docs/modes.md)")
    _opt(g, "reference", default=None, help="mode the printed comparison is against (default: fp32)")


def _add_calibration_options(g) -> None:
    """The calibration options of capture and export (one definition: same names, ranges and defaults)."""
    from .checkpoints.text import DEFAULT_CALIB_FILE

    _opt(g, "calib_data_num", type=_positive_int, default=512, help="calibration samples (default: 512)")
    _opt(g, "calib_seqlen", type=_positive_int, default=512, help="tokens per calibration sample (default: 512)")
    _opt(g, "calib_file", type=Path, default=DEFAULT_CALIB_FILE, help="calibration text (default: the shipped one)")
    _opt(g, "percentile_alpha", type=_alpha, default=0.9995, help="percentile of the s_u and s_h observers (default: 0.9995)")
    _opt(g, "calib_batch_size", type=_positive_int, default=8, help="calibration samples per forward (default: 8)")
    _opt(g, "seed", type=_seed, default=42, help="seed of the order of calibration documents (default: 42)")
    _opt(g, "cache_dir", type=Path, default=None,
         help="calibration cache (default: $QUAMBA_HARNESS_CACHE or ~/.cache/quamba-harness)")
    _opt(g, "no_cache", action="store_true", help="neither read nor write the calibration cache")


def _add_data_options(p: argparse.ArgumentParser) -> None:
    from .checkpoints.text import DEFAULT_TEXT_FILE

    g = p.add_argument_group("data and calibration")
    _opt(g, "seq_len", type=_positive_int, default=512, help="tokens in the test sample (default: 512)")
    _opt(g, "text_file", type=Path, default=DEFAULT_TEXT_FILE,
         help="test text: JSON lines ({'text': ...}) or plain text (default: the shipped held-out text)")
    _add_calibration_options(g)


def _add_output_options(p: argparse.ArgumentParser) -> None:
    from .emulation.capture import TAP_POINTS

    g = p.add_argument_group("capture and output")
    _opt(g, "output_file", type=Path, default=Path("first_layer_io_all_modes.npz"),
         help="the .npz to write; the stats go to <name>_stats.json (default: first_layer_io_all_modes.npz)")
    _opt(g, "layers", type=_layer, nargs="+", default=["0"],
         help="blocks whose input/output/residual are captured: indices, all, -1 (the last), ranges 0-5 (default: 0)")
    _opt(g, "isolated", action="store_true", help="also run each captured block on the reference's input to it: "
                                                 "L<i>.block.isolated (the error the layer adds by itself)")
    _opt(g, "end-to-end", action="store_true", help="run every block, the final norm and lm_head: logits, KL, "
                                                   "top-1 agreement, cross-entropy and perplexity against the reference")
    _opt(g, "samples", type=_positive_int, default=1, help="disjoint windows of --seq_len tokens from the text, "
                                                          "each run alone; metrics per sample and as mean with 95 %% CI")
    _opt(g, "sensitivity", action="store_true", help="KL of the model with only one captured layer in each mode "
                                                    "(one extra forward per layer and mode; implies --end-to-end)")
    _opt(g, "device", choices=("cpu", "cuda"), default="cpu", help="where the emulation runs (default: cpu)")
    _opt(g, "taps", nargs="+", default=[], metavar="TAP",
         help=f"internal points for every captured layer: all, {', '.join(TAP_POINTS)}, or L<i>.<point>")
    _opt(g, "basis", choices=("original", "rotated"), default="original",
         help="basis of the stored residual-stream tensors (default: original)")
    _opt(g, "stats-only", action="store_true", help="write statistics and comparisons, not the arrays")
    _opt(g, "resume", action="store_true", help="keep every mode already in --output_file, add the new ones")
    _opt(g, "rerun", nargs="+", default=[], metavar="MODE", help="with --resume: run these modes again although "
                                                                "the file holds them")
    _opt(g, "compress", action="store_true", help="deflate the .npz (smaller, slower)")
    _opt(g, "dedup", action="store_true", help="store a tap array identical to an earlier one once, as an alias "
                                               "in the stats (smaller; plain np.load then misses those keys)")
    _opt(g, "no-dedup", action="store_true", help=argparse.SUPPRESS)  # the default since schema 3
    _opt(g, "no-logits", action="store_true", help="with --end-to-end: every metric, not the logits arrays")
    _opt(g, "quiet", action="store_true", help="print only errors and the file names")
    _opt(g, "report", action="store_true", help="also write the HTML report <name>_report.html (see `report`)")
    _opt(g, "decode", type=_positive_int, default=0, help="N teacher-forced one-token steps after the prompt (docs/decode.md)")
    _opt(g, "generate", type=_positive_int, default=0, help="N greedy tokens per mode after the prompt (docs/decode.md)")
    _opt(g, "workers", type=_positive_int, default=1, help="run the units in N local processes (docs/scale-out.md)")
    _opt(g, "ray", default=None, metavar="ADDRESS", help="run the units on the Ray cluster at ADDRESS or auto")


def build_capture_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Run a Mamba model under each mode, capture layer I/O "
                                "through forward hooks, write one .npz and one _stats.json.")
    _add_model_options(p)
    _add_mode_options(p)
    _add_data_options(p)
    _add_output_options(p)
    return p


def _config_from_args(args: argparse.Namespace):
    from .runner.calibration import CalibrationSettings, default_cache_dir
    from .runner.pipeline import DEFAULT_MODEL, RunConfig

    if args.pretrained_dir is not None:
        model = args.pretrained_dir / (args.model or DEFAULT_MODEL.name)
    else:
        model = Path(args.model) if args.model else DEFAULT_MODEL
    return RunConfig(
        model=model, mamba_model_path=args.mamba_model_path, tokenizer=args.tokenizer, modes=args.modes, modes_file=args.modes_file,
        output_file=args.output_file, seq_len=args.seq_len, text_file=args.text_file,
        calib=CalibrationSettings(args.calib_data_num, args.calib_seqlen, args.percentile_alpha,
                                  args.calib_batch_size, args.seed),
        calib_file=args.calib_file, cache_dir=None if args.no_cache else (args.cache_dir or default_cache_dir()),
        layers=args.layers, taps=args.taps, basis=args.basis, stats_only=args.stats_only, resume=args.resume,
        compress=args.compress, dedup=args.dedup, reference=args.reference or "fp32", argv=sys.argv[:],
        rerun=args.rerun, reference_required=args.reference is not None, samples=args.samples,
        isolated=args.isolated, end_to_end=args.end_to_end or args.sensitivity, sensitivity=args.sensitivity,
        device=args.device, keep_arrays=False, report=args.report, decode=args.decode,
        generate=args.generate, store_logits=not args.no_logits, workers=args.workers, ray=args.ray)


def _guarded(command, argv: list[str] | None, prog: str | None) -> int:
    """Run command(argv, prog, progress) with SIGINT/SIGTERM turned into a clean exit (130/143, one line
    saying what the command was doing and what is on disk, no traceback)."""
    from .runtime.guard import Interrupted, Progress, handle_signals

    progress = Progress.on_stderr()  # the long phases shown while they run (capture, export; not with --quiet)
    try:
        with handle_signals():
            return command(argv, prog, progress)
    except Interrupted as e:
        print(f"interrupted by {e.name} while {progress.phase}: {progress.kept()}", file=sys.stderr)
        return e.exit_code


def capture_main(argv: list[str] | None = None, prog: str | None = None) -> int:
    return _guarded(_capture, argv, prog)


def _capture(argv: list[str] | None, prog: str | None, progress) -> int:
    args = build_capture_parser(prog).parse_args(argv)
    from .runner.pipeline import InputError, run

    try:
        outcome = run(_config_from_args(args), emit=(lambda _s: None) if args.quiet else print,
                      progress=progress.silenced(args.quiet))
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.quiet:
        print(args.output_file)
    if args.report and _write_report(args.output_file, args.reference) != 0:
        return 2
    return 1 if outcome.failed else 0


def _write_report(npz: Path, reference: str) -> int:
    """capture --report: the HTML report of the file just written (harness.report); without the
    reference mode (not run, or failed) the report has no comparison, as the capture's output."""
    from .report.build import write_report
    from .store.format import StorageError

    try:
        out = write_report(npz, reference=reference, require_reference=False)
    except StorageError as e:
        print(f"error: report: {e}", file=sys.stderr)
        return 2
    print(f"wrote report {out}")
    return 0


def build_compare_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Compare every mode of a capture file against a reference "
                                "mode: MSE, MAE, RMSE, max|err|, relative L2, SQNR, cosine, Pearson, |err| percentiles.")
    p.add_argument("file", type=Path, help="capture .npz (this harness's or the research tool's)")
    _opt(p, "reference", default="fp32", help="reference mode (default: fp32)")
    _opt(p, "json", type=Path, default=None, help="write all metrics to this JSON file")
    _opt(p, "save_comparison", type=Path, default=None, help="research-tool name of --json")
    _opt(p, "modes", nargs="+", default=None, help="compare only these modes")
    _opt(p, "tensors", nargs="+", default=None, help="compare only these tensors (e.g. output L0.ssm.u)")
    _opt(p, "fail-if", default=None, metavar="EXPR",
         help="exit 1 if EXPR holds for any mode and tensor, e.g. \"tensor == 'output' and sqnr_db < 20\"")
    _opt(p, "against", type=Path, default=None, help="compare the same modes of FILE against this run (docs/decode.md)")
    for tol in ("atol", "rtol"): _opt(p, tol, type=float, default=0.0, help=f"with --against: {tol} (default: 0)")
    return p


def compare_main(argv: list[str] | None = None, prog: str | None = None) -> int:
    return _guarded(_compare, argv, prog)


def _compare(argv: list[str] | None, prog: str | None, progress) -> int:
    progress.phase = "comparing"
    args = build_compare_parser(prog).parse_args(argv)
    if args.against is not None:  # two runs of the same modes (runner.crossrun, docs/decode.md)
        return importlib.import_module("harness.runner.crossrun").command(args, print)
    from .metrics.compare import CompareError, compare_modes, compared_pairs, fail_if_violations, same_basis
    from .report.compare_text import compare_output, gate_line
    from .store.format import StorageError, check_output, check_writable, pending_path, stats_path, write_json
    from .store.reader import load_capture

    out = args.json or args.save_comparison
    try:
        if out is not None:
            check_writable(out)
            check_output(out, {"the capture file": args.file, "the capture's stats file": stats_path(args.file),
                               "the capture's pending stats file": pending_path(args.file)})
        if args.fail_if is not None:
            fail_if_violations(args.fail_if, {"modes": {}})  # a bad expression is exit 2 before any work
        cf = load_capture(args.file)
        if (cf.manifest or {}).get("stats_only"):
            raise StorageError(f"{args.file} was written with --stats-only and holds no arrays; "
                               f"its statistics and comparison are in {stats_path(args.file)}")
        for what, asked, present in (("--modes", args.modes, cf.modes()),
                                     ("--tensors", args.tensors, sorted({t for m in cf.modes() for t in cf.tensors(m)}))):
            unknown = [x for x in asked or [] if x not in present]
            if unknown:
                raise CompareError(f"{what} {' '.join(unknown)} matches nothing in {args.file}; "
                                   f"present: {', '.join(present) or 'none'}")
        tensors = {m: [t for t in cf.tensors(m) if args.tensors is None or t in args.tensors]
                   for m in cf.modes() if args.modes is None or m in args.modes or m == args.reference}
        comparable = same_basis(lambda m, t: cf.tensor_meta(m, t).get("basis"), args.reference) if cf.manifest else None
        comparison = compare_modes(tensors, cf.array, args.reference, comparable)
        hits = fail_if_violations(args.fail_if, comparison) if args.fail_if else []
    except (StorageError, CompareError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text, failed_text = compare_output(comparison, cf.manifest or {}, tensors, args.reference, args.modes, args.tensors)
    print(f"{args.file}: {len(tensors)} modes" + ("" if cf.manifest else " (research-tool file, no manifest)")
          + ("; logits not stored (--no-logits)" if (cf.manifest or {}).get("logits_stored") is False else ""))
    print(text)
    if failed_text:
        print("\n".join(failed_text), file=sys.stderr)
    if out is not None:
        write_json(out, comparison)
        print(f"\nwrote {out}")
    if compared_pairs(comparison) == 0:
        print(f"\nnothing was compared: no mode shares a comparable tensor with {args.reference}", file=sys.stderr)
        if args.fail_if:
            return 1
    if hits:
        print(f"\n--fail-if {args.fail_if!r} holds (or compares a NaN metric) for: "
              + ", ".join(f"{m} {t}" for m, t in hits), file=sys.stderr)
    if args.fail_if and comparison["failed_modes"]:  # a mode in error is never a pass
        print(gate_line(comparison["failed_modes"]), file=sys.stderr)
    return 1 if hits or (args.fail_if and comparison["failed_modes"]) else 0


def build_export_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Calibrate every layer of a float Mamba model and write a "
                                "Quamba1 W8A8 checkpoint (config.json, pytorch_model.bin, tokenizer) as Quamba's "
                                "save_pretrained does.")
    _opt(p, "model", type=Path, required=True, help="the float model directory (transformers or mamba_ssm layout)")
    _opt(p, "output_dir", type=Path, required=True, help="new (or empty) directory to write")
    _opt(p, "tokenizer", type=Path, default=None, help="directory with tokenizer.json (default: the model directory)")
    _opt(p, "quantize_embedding", action="store_true",
         help="store the embedding as W8O16Embedding (Quamba's --quantize_embedding); default: fp16, as Quamba1")
    _opt(p, "quantize_lm_head", action="store_true",
         help="store lm_head as W8A8B16O16Linear and norm_f with its output scale (Quamba's --quantize_lm_head; "
              "one more calibration pass through every layer); default: fp16, as Quamba1")
    g = p.add_argument_group("calibration (as for capture; the calibration cache is shared)")
    _add_calibration_options(g)
    _opt(p, "quiet", action="store_true", help="print only errors and the output directory")
    return p


def export_main(argv: list[str] | None = None, prog: str | None = None) -> int:
    return _guarded(_export, argv, prog)


def _export(argv: list[str] | None, prog: str | None, progress) -> int:
    args = build_export_parser(prog).parse_args(argv)
    from .runner.calibration import CalibrationSettings, default_cache_dir
    from .runner.export import INPUT_ERRORS, ExportConfig, export

    cfg = ExportConfig(model=args.model, output_dir=args.output_dir, tokenizer=args.tokenizer,
                       calib=CalibrationSettings(args.calib_data_num, args.calib_seqlen, args.percentile_alpha,
                                                 args.calib_batch_size, args.seed),
                       calib_file=args.calib_file,
                       cache_dir=None if args.no_cache else (args.cache_dir or default_cache_dir()),
                       quantize_embedding=args.quantize_embedding, quantize_lm_head=args.quantize_lm_head)
    try:
        export(cfg, emit=(lambda _s: None) if args.quiet else print, progress=progress.silenced(args.quiet))
    except INPUT_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.quiet:
        print(args.output_dir)
    return 0


def _modes_main(argv: list[str]) -> int:
    from tabulate import tabulate

    from .modes import BUILTIN_MODES, KNOBS, MAMBA2_PRESETS, PRESETS

    rows = [[r.name, r.title, *r.knobs().values()] for r in BUILTIN_MODES.values()]
    print(tabulate(rows, headers=["mode", "name", *KNOBS]))
    print("\npresets: " + "; ".join(f"{k} = {' '.join(v)}" for k, v in PRESETS.items()))
    print("on a Mamba-2 model: " + "; ".join(f"{k} = {' '.join(v) or '(none)'}" for k, v in MAMBA2_PRESETS.items()))
    return 0


def _points_main(argv: list[str]) -> int:
    from .runner.points import points_main

    return points_main(argv, lambda line: print(line), lambda line: print(line, file=sys.stderr))


def _report_main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """The report command; matplotlib is imported only when a report is asked for."""
    from .report.build import report_main

    return _guarded(lambda args, name, _progress: report_main(args, name), argv, prog)


_USAGE = """usage: python -m harness COMMAND [options]   (python -m harness COMMAND --help for its options)

commands:
  capture   run modes on a model and write the .npz + _stats.json pair (save_first_layer_io.py)
  compare   compare every mode of a capture against the reference (compare_with_fp.py)
  report    write the HTML report of a capture
  export    calibrate and write a Quamba W8A8 checkpoint
  modes     list the built-in modes with their knobs, and the presets
  points    list the capture points (taps) and what each one holds
  formats   list the number formats; with FILE.npz, the error of every captured tensor in each format"""


# the modules a command imports when it runs (torch with them): the entry points load them while the
# start-up handler still leaves quietly (harness.runtime.startup), never under the run's own handlers,
# where a signal raised inside torch's import could abort the process
_HEAVY = {"capture": "harness.runner.pipeline", "export": "harness.runner.export", "report": "harness.report.build",
          "formats": "harness.report.formats"}


def preload(command: str | None) -> None:
    """Import what `command` (capture, export, report, ...) will need; nothing for the light commands."""
    if command in _HEAVY:
        importlib.import_module(_HEAVY[command])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"capture": capture_main, "compare": compare_main, "export": export_main, "report": _report_main,
                "modes": _modes_main, "points": _points_main,
                "formats": lambda rest: importlib.import_module(  # --suggest runs models: runner.suggest
                    "harness.runner.suggest" if "--suggest" in rest else "harness.report.formats").formats_command(rest)}
    if argv[:1] in (["-h"], ["--help"]):
        print(_USAGE)
        return 0
    if not argv or argv[0] not in commands:
        if argv:
            print(f"error: unknown command {argv[0]!r}; valid: {', '.join(commands)}", file=sys.stderr)
        print(_USAGE, file=sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    if name in ("capture", "compare", "export", "report"):
        return commands[name](rest, prog=f"python -m harness {name}")
    return commands[name](rest)
