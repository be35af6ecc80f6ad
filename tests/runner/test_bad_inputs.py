"""Every bad input: exit 2, a message naming what is wrong (and what is valid), no traceback, no file.

One table: (case, command, arguments, fragment of the expected message). Commands run in-process
(capture_main / compare_main, as the entry scripts call them); each case gets a fresh output directory,
which must stay empty, and the shared directory of inputs must be unchanged afterwards.
"""
import io
import json
import os
import shutil
import zipfile

import numpy as np
import pytest

from conftest import make_hf_model, write_hf_dir
from helpers import FAST_CLI, run_cli
from harness.cli import capture_main, compare_main
from harness.store.format import stats_path

FAST = FAST_CLI
_main = run_cli


def _model_variant(ctx, name, edit_config=None, drop=None, extra=None):
    d = ctx / name
    shutil.copytree(ctx / "m", d)
    if edit_config:
        cfg = json.loads((d / "config.json").read_text())
        edit_config(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    for f in drop or []:
        (d / f).unlink()
    for f, content in (extra or {}).items():
        (d / f).write_bytes(content) if isinstance(content, bytes) else (d / f).write_text(content)
    return d


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    """Inputs, good and bad, in one directory; a valid capture pair for the comparator and --resume."""
    c = tmp_path_factory.mktemp("bad")
    write_hf_dir(c / "m", make_hf_model(n_layer=2, seed=7))
    write_hf_dir(c / "small-vocab", make_hf_model(vocab=64, n_layer=1, seed=7))
    _model_variant(c, "wrong-width", lambda cfg: cfg.update(hidden_size=32))
    _model_variant(c, "nan-eps", lambda cfg: cfg.update(layer_norm_epsilon="nan"))
    _model_variant(c, "zero-layers", lambda cfg: cfg.update(num_hidden_layers=0))
    _model_variant(c, "three-layers", lambda cfg: cfg.update(num_hidden_layers=3))
    _model_variant(c, "architectures-int", lambda cfg: cfg.update(architectures=5))
    _model_variant(c, "jamba", lambda cfg: cfg.update(model_type="jamba", architectures=["JambaForCausalLM"]))
    _model_variant(c, "unknown-type", lambda cfg: cfg.update(model_type="quux"))
    _model_variant(c, "unknown-class", lambda cfg: cfg.update(architectures=["JambaForCausalLM"]))
    _model_variant(c, "inf-state", lambda cfg: cfg.update(state_size=float("inf")))
    _model_variant(c, "fraction-expand", lambda cfg: cfg.update(expand=2.5, intermediate_size=None))
    huge = json.dumps(json.loads((c / "m" / "config.json").read_text())).replace('"conv_kernel": 4',
                                                                               '"conv_kernel": ' + "4" * 5000)
    _model_variant(c, "huge-int", extra={"config.json": huge})
    _model_variant(c, "no-config", drop=["config.json"])
    _model_variant(c, "bad-json", extra={"config.json": "{not json"})
    _model_variant(c, "list-config", extra={"config.json": "[1, 2]"})
    _model_variant(c, "garbage-weights", extra={"model.safetensors": b"\x10\x00\x00\x00\x00\x00\x00\x00{bad"})
    shard = {"weight_map": {"backbone.embeddings.weight": "model-00001.safetensors"}}
    _model_variant(c, "missing-shard", drop=["model.safetensors"],
                   extra={"model.safetensors.index.json": json.dumps(shard)})
    shard = {"weight_map": {"backbone.embeddings.weight": "../m/model.safetensors"}}
    _model_variant(c, "escaping-shard", drop=["model.safetensors"],
                   extra={"model.safetensors.index.json": json.dumps(shard)})
    _model_variant(c, "list-index", drop=["model.safetensors"],
                   extra={"model.safetensors.index.json": json.dumps({"weight_map": ["a"]})})
    _model_variant(c, "bad-tokenizer", extra={"tokenizer.json": "{\"no\": 1}"})
    _model_variant(c, "no-tokenizer", drop=["tokenizer.json"])
    _model_variant(c, "bad-bpe", drop=["tokenizer.json"], extra={"vocab.json": "[1]", "merges.txt": "a b c d\n"})
    (c / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 100)
    (c / "list.jsonl").write_text('[1, 2]\n')
    (c / "int.jsonl").write_text('{"text": 5}\n')
    (c / "broken.jsonl").write_text('{"text": "a"\n')
    (c / "short.txt").write_text("to be or not to be " * 20)
    (c / "x_stats.json").write_text("{}")
    modes = {"base-list": {"modes": {"u": {"base": ["2-4"]}}}, "int-knob": {"modes": {"u": {"base": "2-4", "conv_in": 1}}},
             "title-list": {"modes": {"u": {"base": "2-4", "title": ["x"]}}}, "ok": {"modes": {"u": {"base": "2-4"}}},
             "far-layer": {"modes": {"u": {"base": "fp32", "layers": {"0": {"act_format": "bf16"},
                                                                      "99": {"act_format": "bf16"}}}}},
             "far-open-range": {"modes": {"u": {"base": "fp32", "layers": {"2-": {"act_format": "bf16"}}}}}}
    for name, body in modes.items():
        (c / f"{name}.json").write_text(json.dumps(body))
    (c / "latin1.json").write_bytes(b'{"modes": {"\xe9": {}}}')
    os.mkfifo(c / "fifo")
    (c / "dir.npz").mkdir()
    # a valid pair, and broken variants of it
    assert _main(capture_main, ["--model", c / "m", "--modes", "fp32", "--output_file", c / "good.npz",
                                "--no_cache", "--quiet", *FAST]) == 0
    for name in ("mismatch", "nostats", "schema99", "modes-list", "bad-aliases", "stats-garbage"):
        shutil.copy(c / "good.npz", c / f"{name}.npz")
        shutil.copy(stats_path(c / "good.npz"), stats_path(c / f"{name}.npz"))
    stats_path(c / "nostats.npz").unlink()
    with open(c / "mismatch.npz", "ab") as f:
        f.write(b"\0")
    good = json.loads(stats_path(c / "good.npz").read_text())
    for name, change in (("schema99", {"schema_version": 99}), ("modes-list", {"modes": ["fp32"]}),
                         ("bad-aliases", {"aliases": {"mode_fp32__L0.ssm.u": 3}})):
        stats_path(c / f"{name}.npz").write_text(json.dumps({**good, **change}))
    stats_path(c / "stats-garbage.npz").write_text("{{{")
    np.savez(c / "objects.npz", mode_fp32_output=np.zeros(3, np.float32), mode_a_output=np.array([{}, 1], dtype=object))
    with zipfile.ZipFile(c / "junk-member.npz", "w") as z:
        z.writestr("mode_fp32_output.npy", b"not an array")
        z.writestr("mode_a_output.npy", b"not an array")
    np.savez(c / "scalar-member.npz", mode_fp32_output=np.float32(1.0), mode_a_output=np.zeros((1, 4, 3), np.float32))
    with zipfile.ZipFile(c / "deflate-member.npz", "w", compression=zipfile.ZIP_DEFLATED) as z:
        member = io.BytesIO()
        np.save(member, np.zeros((1, 64, 8), np.float32))
        z.writestr("mode_fp32_output.npy", member.getvalue())
        z.writestr("mode_a_output.npy", member.getvalue())
    data = bytearray((c / "deflate-member.npz").read_bytes())
    at = data.index(b"mode_fp32_output.npy") + len("mode_fp32_output.npy")
    data[at + 4:at + 12] = bytes(b ^ 0xFF for b in data[at + 4:at + 12])  # the member's deflate stream, corrupted
    (c / "deflate-member.npz").write_bytes(bytes(data))
    np.save(c / "single.npy", np.zeros(3))
    (c / "garbage.npz").write_bytes(b"PK\x03\x04 garbage")
    return c


C, P = capture_main, compare_main
M = ["--model", "{c}/m", "--modes", "fp32", "0"]
# (case id, command, arguments ({c} = inputs dir, {o} = this case's output dir), expected message fragment)
CASES = [
    ("unknown-mode", C, ["--model", "{c}/m", "--modes", "fp32", "2-9"], "unknown mode '2-9'; valid: fp32, 1, 0"),
    ("seq-len-0", C, [*M, "--seq_len", "0"], "--seq_len/--seq-len: must be a positive integer, got 0"),
    ("seq-len-huge-int", C, [*M, "--seq_len", "9" * 40], "must be a positive integer, got '9999"),
    ("seq-len-over-limit", C, [*M, "--seq_len", "2000000000"], "positive integer of at most 1000000000"),
    ("seq-len-too-long", C, [*M, "--seq_len", "100000"], "fewer than --seq_len 100000"),
    ("calib-num-negative", C, [*M, "--calib_data_num", "-1"], "must be a positive integer, got -1"),
    ("calib-too-many", C, [*M, "--calib_data_num", "100000"], "--calib_data_num 100000 is too many"),
    ("alpha-nan", C, [*M, "--percentile_alpha", "nan"], "must be in (0, 1], got nan"),
    ("alpha-zero", C, [*M, "--percentile_alpha", "0"], "must be in (0, 1], got 0.0"),
    ("seed-negative", C, [*M, "--seed", "-1"], "must be an integer in 0..2^63-1"),
    ("seed-float", C, [*M, "--seed", "1e3"], "must be an integer in 0..2^63-1, got '1e3'"),
    ("layer-negative", C, [*M, "--layers", "-3"], "has 2 blocks (valid: 0..1, -1..-2 from the end"),
    ("layer-syntax", C, [*M, "--layers", "1-"], "must be all, a block index (0, 1, ...), -1 for the last, or a range"),
    ("layer-range", C, [*M, "--layers", "0-2"], "range '0-2' does not fit: the model has 2 blocks (valid: 0..1,"),
    ("layer-range-reversed", C, [*M, "--layers", "1-0"], "range '1-0' does not fit"),
    ("layer-beyond", C, [*M, "--layers", "7"], "has 2 blocks (valid: 0..1,"),
    ("tap-unknown", C, [*M, "--taps", "ssm.v"], "unknown tap 'ssm.v'; valid: all, norm.out"),
    ("tap-bad-layer", C, [*M, "--taps", "Lx.ssm.u"], "unknown tap 'Lx.ssm.u'"),
    ("tap-deep-layer", C, [*M, "--taps", "L99999999999.ssm.u"], "has 2 blocks (valid: 0..1)"),
    ("tap-bad-point", C, [*M, "--taps", "L0.ssm.u.x"], "invalid capture point 'L0.ssm.u.x'"),
    ("reference-not-run", C, [*M, "--reference", "2-4"], "--reference '2-4' is not one of this run's modes (fp32, 0)"),
    ("basis", C, [*M, "--basis", "diag"], "invalid choice: 'diag' (choose from 'original', 'rotated')"),
    ("rerun-without-resume", C, [*M, "--rerun", "0"], "--rerun only applies with --resume"),
    ("out-dev-null", C, [*M, "--output_file", "/dev/null"], "cannot write /dev/null: it is a character device"),
    ("out-directory", C, [*M, "--output_file", "{c}/dir.npz"], "dir.npz: it is a directory, not a regular file"),
    ("out-fifo", C, [*M, "--output_file", "{c}/fifo"], "fifo: it is a FIFO, not a regular file"),
    ("out-no-suffix", C, [*M, "--output_file", "{o}/noext"], "must end in .npz, e.g. "),
    ("out-other-suffix", C, [*M, "--output_file", "{o}/run.npy"], "run.npy: the capture file's name must end in .npz"),
    ("out-missing-dir", C, [*M, "--output_file", "{o}/no/such/out.npz"], "no/such does not exist"),
    ("out-is-text", C, [*M, "--text_file", "{c}/short.txt", "--output_file", "{c}/short.txt"],
     "short.txt: it is the text file of this run"),
    ("out-is-config", C, [*M, "--output_file", "{c}/m/config.json"], "it is the model's config.json of this run"),
    ("out-is-weights", C, [*M, "--output_file", "{c}/m/model.safetensors"], "it is a weight file of the model"),
    ("out-is-tokenizer", C, [*M, "--output_file", "{c}/m/tokenizer.json"], "it is the tokenizer of this run"),
    ("stats-is-calib", C, [*M, "--calib_file", "{c}/x_stats.json", "--output_file", "{c}/x.npz"],
     "x_stats.json: it is the calibration file of this run"),
    ("out-is-modes-file", C, [*M, "--modes_file", "{c}/ok.json", "--output_file", "{c}/ok.json"],
     "ok.json: it is the modes file of this run"),
    ("model-missing", C, ["--model", "{c}/nowhere"], "nowhere does not exist; a model directory must contain"),
    ("model-no-config", C, ["--model", "{c}/no-config"], "config.json is missing"),
    ("config-not-json", C, ["--model", "{c}/bad-json"], "config.json is not valid JSON"),
    ("config-a-list", C, ["--model", "{c}/list-config"], "config.json must hold a JSON object"),
    ("config-wrong-width", C, ["--model", "{c}/wrong-width"], "but config.json implies"),
    ("config-nan-eps", C, ["--model", "{c}/nan-eps"], "the norm epsilon must be a finite number in (0, 1), got nan"),
    ("config-zero-layers", C, ["--model", "{c}/zero-layers"], "sizes must be positive integers up to 2^20, got n_layer=0"),
    ("config-more-layers", C, ["--model", "{c}/three-layers"], "config.json says the model has 3 blocks"),
    ("config-architectures-int", C, ["--model", "{c}/architectures-int"], "'architectures' must be a list of class"),
    ("config-jamba", C, ["--model", "{c}/jamba"],
     "model_type 'jamba' is not supported; supported model types: mamba, mamba2, falcon_mamba"),
    ("config-unknown-type", C, ["--model", "{c}/unknown-type"], "model_type 'quux' is not supported"),
    ("config-unknown-class", C, ["--model", "{c}/unknown-class"],
     "architectures entry 'JambaForCausalLM' is not supported; supported: MambaForCausalLM"),
    ("config-inf-size", C, ["--model", "{c}/inf-state"], "'state_size' must be an integer (a JSON number such as 2"),
    ("config-fraction", C, ["--model", "{c}/fraction-expand"], "'expand' must be an integer (a JSON number such as 2"),
    ("config-huge-int", C, ["--model", "{c}/huge-int"], "'conv_kernel' is an integer of 5000 digits"),
    ("weights-garbage", C, ["--model", "{c}/garbage-weights"], "model.safetensors: cannot read weights"),
    ("shard-missing", C, ["--model", "{c}/missing-shard"], "shard model-00001.safetensors"),
    ("shard-escapes", C, ["--model", "{c}/escaping-shard"], "shard entries must be file names inside"),
    ("index-not-table", C, ["--model", "{c}/list-index"], "'weight_map' must be a non-empty table"),
    ("tokenizer-garbage", C, ["--model", "{c}/bad-tokenizer"], "tokenizer.json cannot be read as a tokenizer"),
    ("tokenizer-missing", C, ["--model", "{c}/no-tokenizer"], "no tokenizer in"),
    ("tokenizer-bad-bpe", C, ["--model", "{c}/bad-bpe"], "cannot be read as a byte-level BPE tokenizer"),
    ("tokenizer-vs-model", C, ["--model", "{c}/small-vocab", "--modes", "fp32"],
     "the tokenizer does not match the model"),
    ("text-dev-zero", C, [*M, "--text_file", "/dev/zero"], "text file /dev/zero is a character device"),
    ("text-directory", C, [*M, "--text_file", "{c}/m"], "is a directory, not a regular file; give a UTF-8 text"),
    ("text-not-utf8", C, [*M, "--text_file", "{c}/latin1.txt"], "latin1.txt is not UTF-8"),
    ("jsonl-list", C, [*M, "--text_file", "{c}/list.jsonl"], "list.jsonl:1: a JSON list without a 'text' field"),
    ("jsonl-int-text", C, [*M, "--text_file", "{c}/int.jsonl"], "int.jsonl:1: a 'text' field of type int"),
    ("jsonl-broken", C, [*M, "--text_file", "{c}/broken.jsonl"], "broken.jsonl:1: not a JSON object"),
    ("calib-dev-zero", C, [*M, "--calib_file", "/dev/zero"], "text file /dev/zero is a character device"),
    ("modes-file-missing", C, [*M, "--modes_file", "{c}/nope.json"], "cannot read modes file"),
    ("modes-file-dev-zero", C, [*M, "--modes_file", "/dev/zero"], "is not a regular file"),
    ("modes-file-latin1", C, [*M, "--modes_file", "{c}/latin1.json"], "is not UTF-8"),
    ("modes-base-list", C, [*M, "--modes_file", "{c}/base-list.json"], "unknown base ['2-4']"),
    ("modes-knob-int", C, [*M, "--modes_file", "{c}/int-knob.json"], "knob values must be strings (conv_in)"),
    ("modes-title-list", C, [*M, "--modes_file", "{c}/title-list.json"], "title must be a string, got list"),
    ("modes-layers-beyond", C, ["--model", "{c}/m", "--modes", "fp32", "u", "--modes_file", "{c}/far-layer.json"],
     "mode 'u': layers range '99' names no block of the model, which has 2 blocks (valid: ranges within 0..1"),
    ("modes-layers-open-beyond", C, ["--model", "{c}/m", "--modes", "fp32", "u", "--modes_file",
                                     "{c}/far-open-range.json"], "layers range '2-' names no block of the model"),
    ("resume-mismatch", C, [*M, "--resume", "--output_file", "{c}/mismatch.npz"], "does not match"),
    ("resume-no-stats", C, [*M, "--resume", "--output_file", "{c}/nostats.npz"], "has no stats file"),
    ("resume-stats-only", C, [*M, "--resume", "--stats-only", "--output_file", "{c}/good.npz"],
     "--resume does not work with --stats-only files"),
    ("resume-schema", C, [*M, "--resume", "--output_file", "{c}/schema99.npz"], "schema_version 99 is not supported"),
    ("resume-modes-list", C, [*M, "--resume", "--output_file", "{c}/modes-list.npz"],
     "is not a valid stats file: field modes: expected an object, got a list"),
    ("cmp-missing", P, ["{c}/nope.npz"], "capture file {c}/nope.npz does not exist"),
    ("cmp-garbage", P, ["{c}/garbage.npz"], "is not a readable .npz file"),
    ("cmp-dev-zero", P, ["/dev/zero"], "capture file /dev/zero is a character device"),
    ("cmp-fifo", P, ["{c}/fifo"], "is a FIFO; give a .npz file"),
    ("cmp-single-npy", P, ["{c}/single.npy"], "holds a single array, not a .npz archive"),
    ("cmp-object-array", P, ["{c}/objects.npz"], "cannot read array mode_a_output"),
    ("cmp-junk-member", P, ["{c}/junk-member.npz"], "cannot read array mode_fp32_output"),
    ("cmp-scalar-member", P, ["{c}/scalar-member.npz"], "member mode_fp32_output.npy holds a 0-d value"),
    ("cmp-scalar-member-fail-if", P, ["{c}/scalar-member.npz", "--fail-if", "mse > 1"],
     "member mode_fp32_output.npy holds a 0-d value"),
    ("cmp-deflate-member", P, ["{c}/deflate-member.npz"], "member mode_fp32_output.npy"),
    ("cmp-mismatched-pair", P, ["{c}/mismatch.npz"], "does not match"),
    ("cmp-stats-garbage", P, ["{c}/stats-garbage.npz"], "cannot read"),
    ("cmp-bad-aliases", P, ["{c}/bad-aliases.npz"], "field aliases.mode_fp32__L0.ssm.u: expected a string, got an integer"),
    ("cmp-reference", P, ["{c}/good.npz", "--reference", "0"], "reference mode '0' is not in the file"),
    ("cmp-modes-filter", P, ["{c}/good.npz", "--modes", "2-9"], "--modes 2-9 matches nothing"),
    ("cmp-tensors-filter", P, ["{c}/good.npz", "--tensors", "outptu"], "--tensors outptu matches nothing"),
    ("cmp-fail-if-nested", P, ["{c}/good.npz", "--fail-if", "not " * 200 + "identical"], "nested too deeply"),
    ("cmp-fail-if-parens", P, ["{c}/good.npz", "--fail-if", "(" * 300 + "mse" + ")" * 300], "--fail-if"),
    ("cmp-fail-if-long", P, ["{c}/good.npz", "--fail-if", " or ".join(["mse > 1"] * 400)], "at most 2000"),
    ("cmp-fail-if-call", P, ["{c}/good.npz", "--fail-if", "__import__('os')"], "Call is not allowed"),
    ("cmp-fail-if-name", P, ["{c}/good.npz", "--fail-if", "sqnr < 3"], "unknown name 'sqnr'; valid: mse"),
    ("cmp-fail-if-empty", P, ["{c}/good.npz", "--fail-if", " "], "--fail-if needs an expression"),
    ("cmp-json-is-input", P, ["{c}/good.npz", "--json", "{c}/good.npz"], "it is the capture file of this run"),
    ("cmp-json-is-stats", P, ["{c}/good.npz", "--json", "{c}/good_stats.json"], "the capture's stats file"),
    ("cmp-json-dev-null", P, ["{c}/good.npz", "--json", "/dev/null"], "it is a character device"),
    ("cmp-json-missing-dir", P, ["{c}/good.npz", "--json", "{o}/no/dir/x.json"], "no/dir does not exist"),
]


def _listing(directory):
    return sorted((str(p.relative_to(directory)), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in directory.rglob("*") if not p.is_fifo())


@pytest.mark.parametrize("case,main,args,fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_input(ctx, tmp_path, capsys, case, main, args, fragment):
    before = _listing(ctx)
    out_dir = tmp_path / "o"
    out_dir.mkdir()
    argv = [a.replace("{c}", str(ctx)).replace("{o}", str(out_dir)) for a in args]
    if main is capture_main:  # small defaults first: the case's own options come later and win
        argv = ["--no_cache", "--output_file", str(out_dir / "out.npz"), *FAST, *argv]
    rc = _main(main, argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert fragment.replace("{c}", str(ctx)) in err
    assert "Traceback" not in err
    assert list(out_dir.iterdir()) == []
    assert _listing(ctx) == before
    assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")


def test_the_table_is_large_enough():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


def test_a_layers_range_that_reaches_into_the_model_is_kept():
    """check_layers refuses only ranges that name no block: '1-99' on 2 blocks still names block 1."""
    from dataclasses import replace

    from harness.modes import ModeError
    from harness.recipes.registry import get_mode

    r = replace(get_mode("fp32"), name="u", layers={"1-99": {"act_format": "bf16"}, "0": {"act_format": "bf16"}})
    r.check_layers(2)
    with pytest.raises(ModeError, match="layers range '1-99' names no block of the model, which has 1 blocks"):
        r.check_layers(1)
