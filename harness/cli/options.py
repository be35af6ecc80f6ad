"""The options of the command lines: argument types with messages that say what is valid, options
accepted with underscores and dashes, the option groups capture and export share, and the capture
parser with the RunConfig it makes."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["checked", "MAX_COUNT", "positive_int", "layer_spec", "opt", "add_calibration_options",
           "build_capture_parser", "config_from_args", "add_plugin_option", "plugins_loaded"]


def checked(convert, ok, expected: str):
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


_count = checked(_int, lambda v: v > 0, "a positive integer")


def positive_int(text: str) -> int:
    value = _count(text)
    if value > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"must be a positive integer of at most {MAX_COUNT}, got {value}")
    return value


_alpha = checked(float, lambda v: 0.0 < v <= 1.0, "in (0, 1]")
def layer_spec(text: str) -> str:
    """One --layers item: all, a block index, -1 (the last; -2 the one before), or a range A-B."""
    from ..emulation.capture import LAYER_SPEC_RE

    text = text.strip()
    if len(text) > 30 or not LAYER_SPEC_RE.match(text):
        raise argparse.ArgumentTypeError(f"must be all, a block index (0, 1, ...), -1 for the last, or a range "
                                         f"such as 0-5, got {text!r}")
    return text
_seed = checked(_int, lambda v: 0 <= v < 2**63, "an integer in 0..2^63-1")


def opt(parser: argparse.ArgumentParser, name: str, **kwargs) -> None:
    """Add --a_b together with --a-b (and the reverse), one destination."""
    flags = [f"--{name}"]
    for other in (name.replace("_", "-"), name.replace("-", "_")):
        if f"--{other}" not in flags:
            flags.append(f"--{other}")
    parser.add_argument(*flags, dest=name.replace("-", "_"), **kwargs)


def add_plugin_option(p) -> None:
    """--plugin FILE_OR_MODULE (repeatable), every command's (harness.plugins, docs/plugins.md)."""
    opt(p, "plugin", action="append", default=[], metavar="FILE_OR_MODULE",
        help="load a plugin first: a .py file or a dotted module name that registers recipe families, modes, "
             "checkpoint formats, exporters or architectures (repeatable; docs/plugins.md)")


def plugins_loaded(specs: list[str]) -> bool:
    """The installed entry points and the --plugin specs loaded; False (`error: ...` on stderr) when one fails."""
    from ..plugins import PluginError, load_all

    try:
        load_all(specs)
    except PluginError as e:
        print(f"error: {e}", file=sys.stderr)
        return False
    return True


def _add_model_options(p: argparse.ArgumentParser) -> None:
    from ..runner.pipeline import DEFAULT_MODEL

    g = p.add_argument_group("model")
    opt(g, "model", default=None, help=f"model directory (default: the shipped {DEFAULT_MODEL.name}); "
                                        "with --pretrained_dir, a name inside it")
    opt(g, "pretrained_dir", type=Path, default=None, help="directory holding models: the model is PRETRAINED_DIR/MODEL")
    opt(g, "tokenizer", type=Path, default=None, help="directory with tokenizer.json (default: the model directory)")
    opt(g, "mamba_model_path", type=Path, default=None,
         help="the float model of a quantized Quamba --model (DIR or DIR/mamba-<size>): modes fp32 and 1 "
              "run from it and the pair is checked; ignored with a float --model")


def _add_mode_options(p: argparse.ArgumentParser) -> None:
    from ..modes import BUILTIN_MODES, PRESETS

    g = p.add_argument_group("modes")
    opt(g, "modes", nargs="+", default=["all"], metavar="MODE",
         help=f"modes or presets (default: all). Modes: {', '.join(BUILTIN_MODES)}; presets: "
              + "; ".join(f"{k} = {' '.join(v)}" for k, v in PRESETS.items()))
    opt(g, "modes_file", type=Path, default=None, help="JSON or TOML file of user-defined modes (docs/modes.md)")
    opt(g, "reference", default=None, help="mode the printed comparison is against (default: fp32)")
    add_plugin_option(g)


def add_calibration_options(g) -> None:
    """The calibration options of capture and export (one definition: same names, ranges and defaults)."""
    from ..checkpoints.text import DEFAULT_CALIB_FILE

    opt(g, "calib_data_num", type=positive_int, default=512, help="calibration samples (default: 512)")
    opt(g, "calib_seqlen", type=positive_int, default=512, help="tokens per calibration sample (default: 512)")
    opt(g, "calib_file", type=Path, default=DEFAULT_CALIB_FILE, help="calibration text (default: the shipped one)")
    opt(g, "percentile_alpha", type=_alpha, default=0.9995, help="percentile of the s_u and s_h observers (default: 0.9995)")
    opt(g, "calib_batch_size", type=positive_int, default=8, help="calibration samples per forward (default: 8)")
    opt(g, "seed", type=_seed, default=42, help="seed of the order of calibration documents (default: 42)")
    opt(g, "cache_dir", type=Path, default=None,
         help="calibration cache (default: $QUAMBA_HARNESS_CACHE or ~/.cache/quamba-harness)")
    opt(g, "no_cache", action="store_true", help="neither read nor write the calibration cache")


def _add_data_options(p: argparse.ArgumentParser) -> None:
    from ..checkpoints.text import DEFAULT_TEXT_FILE

    g = p.add_argument_group("data and calibration")
    opt(g, "seq_len", type=positive_int, default=512, help="tokens in the test sample (default: 512)")
    opt(g, "text_file", type=Path, default=DEFAULT_TEXT_FILE,
         help="test text: JSON lines ({'text': ...}) or plain text (default: the shipped held-out text)")
    add_calibration_options(g)


def _add_output_options(p: argparse.ArgumentParser) -> None:
    from ..emulation.capture import TAP_POINTS

    g = p.add_argument_group("capture and output")
    opt(g, "output_file", type=Path, default=Path("first_layer_io_all_modes.npz"),
         help="the .npz to write; the stats go to <name>_stats.json (default: first_layer_io_all_modes.npz)")
    opt(g, "layers", type=layer_spec, nargs="+", default=["0"],
         help="blocks whose input/output/residual are captured: indices, all, -1 (the last), ranges 0-5 (default: 0)")
    opt(g, "isolated", action="store_true", help="also run each captured block on the reference's input to it: "
                                                 "L<i>.block.isolated (the error the layer adds by itself)")
    opt(g, "end-to-end", action="store_true", help="run every block, the final norm and lm_head: logits, KL, "
                                                   "top-1 agreement, cross-entropy and perplexity against the reference")
    opt(g, "samples", type=positive_int, default=1, help="disjoint windows of --seq_len tokens from the text, "
                                                          "each run alone; metrics per sample and as mean with 95 %% CI")
    opt(g, "sensitivity", action="store_true", help="KL of the model with only one captured layer in each mode "
                                                    "(one extra forward per layer and mode; implies --end-to-end)")
    opt(g, "device", choices=("cpu", "cuda"), default="cpu", help="where the emulation runs (default: cpu)")
    opt(g, "taps", nargs="+", default=[], metavar="TAP",
         help=f"internal points for every captured layer: all, {', '.join(TAP_POINTS)}, or L<i>.<point>")
    opt(g, "basis", choices=("original", "rotated"), default="original",
         help="basis of the stored residual-stream tensors (default: original)")
    opt(g, "stats-only", action="store_true", help="write statistics and comparisons, not the arrays")
    opt(g, "resume", action="store_true", help="keep every mode already in --output_file, add the new ones")
    opt(g, "rerun", nargs="+", default=[], metavar="MODE", help="with --resume: run these modes again although "
                                                                "the file holds them")
    opt(g, "compress", action="store_true", help="deflate the .npz (smaller, slower)")
    opt(g, "dedup", action="store_true", help="store a tap array identical to an earlier one once, as an alias "
                                               "in the stats (smaller; plain np.load then misses those keys)")
    opt(g, "no-dedup", action="store_true", help=argparse.SUPPRESS)  # the default since schema 3
    opt(g, "no-logits", action="store_true", help="with --end-to-end: every metric, not the logits arrays")
    opt(g, "quiet", action="store_true", help="print only errors and the file names")
    opt(g, "report", action="store_true", help="also write the HTML report <name>_report.html (see `report`)")
    opt(g, "decode", type=positive_int, default=0, help="N teacher-forced one-token steps after the prompt (docs/decode.md)")
    opt(g, "generate", type=positive_int, default=0, help="N greedy tokens per mode after the prompt (docs/decode.md)")
    opt(g, "workers", type=positive_int, default=1, help="run the units in N local processes (docs/scale-out.md)")
    opt(g, "ray", default=None, metavar="ADDRESS", help="run the units on the Ray cluster at ADDRESS or auto")


def build_capture_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Run a Mamba model under each mode, capture layer I/O "
                                "through forward hooks, write one .npz and one _stats.json.")
    _add_model_options(p)
    _add_mode_options(p)
    _add_data_options(p)
    _add_output_options(p)
    return p


def config_from_args(args: argparse.Namespace):
    from ..runner.calibration import CalibrationSettings, default_cache_dir
    from ..runner.pipeline import DEFAULT_MODEL, RunConfig

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
        generate=args.generate, store_logits=not args.no_logits, workers=args.workers, ray=args.ray,
        plugins=list(args.plugin))
