"""Digest every number a set of runs produces, to prove a change moves none of them (same machine).

    .venv/bin/python tools/snapshot.py before.json              # run the set, write the digests
    .venv/bin/python tools/snapshot.py --compare before.json after.json

The set (small seeded models from tests/'s fixtures, about half a minute on 2 cores; every run
must exit 0) covers what a refactoring could move, with --calib_data_num 4 --calib_seqlen 32:

- Mamba-1, built-in modes: every Quamba1 mode and mode 1 with every tap of two layers, isolated
  replay and two samples (layers); the whole-model path: every layer, end to end, sensitivity
  (whole); Quamba2's q2-w4a8 and q2-w4a16 with GPTQ, every layer and tap, isolated, sensitivity
  (mamba1_w4); the storage options --basis rotated, --dedup, --no-logits, --layers -1 (options);
  the units in two worker processes (workers).
- Mamba-2: every built-in mode (fp32 1 q2-w8a8 q2-w4a8 q2-w4a16) and the eval recipe q2-eval
  (embedding int8, lm_head quantized) with every tap of both blocks, isolated, two samples,
  end to end, sensitivity (mamba2).
- Decode: --decode 4 --generate 4 with every tap of every layer, end to end: fp32, 1, 0, 2-1,
  2-4, 3 on a Mamba-1 model in mamba_ssm's layout (decode_mamba1); fp32, q2-w4a8, q2-w4a16 on
  Mamba-1 (decode_mamba1_w4); the Mamba-2 preset all and Quamba2's variant knobs (x_groups,
  state_dtype, embedding) on a one-group, tied Mamba-2 (decode_mamba2).
- Number formats (FORMAT_MODES, a modes file): MX, NVFP4, fp8, HiFP8, int8/int4 group formats as
  weight_format, act_format and state_format on fp32 and mode 1, and a per-layer `layers` table,
  prefill and steps (formats).
- Checkpoints, no calibration: a Quamba W8A8 with modes 0, 2-1, 2-4, 3 against 0, every layer
  and tap, end to end (quamba); with every layer and tap, end to end and --decode 3: a Quamba2
  W8A8 (quamba2_w8a8_ckpt), Quamba2 W4A8 with the W4 embedding and lm_head and W4A16
  (quamba2_w4a8_ckpt, quamba2_w4a16_ckpt), Quamba2 W4A8 and W4A16 of Mamba-1, W4A16 with the W4
  embedding and lm_head (quamba1_w4a8_ckpt, quamba1_w4a16_ckpt), each in its own mode.
- The harness's own `export` (Quamba1 W8A8, Mamba-1 W4A8, Quamba2 W8A8, Quamba2 W4A16), run as
  the checkpoints above with --mamba_model_path (paired with its float model, which fp32 and 1
  run from) (export_*).

For each run it records the exit code, the sha256 of every array of the .npz and every value of
the _stats.json, flattened to dotted paths, leaving out what changes from run to run
(timestamps, timings, temporary paths, the command line). Writing a snapshot exits 1 when a run
did not exit 0 (the file is written all the same). The comparison prints the first differences
and exits 1 if there are any.

Not covered: the commands that write no capture (compare, report, formats sweep and --suggest);
--resume, --stats-only, --compress and --device cuda.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "fixtures")]

ALL_MODES = ["fp32", "1", "0", "2-0", "2-1", "2-2", "2-3", "2-4", "3"]
M2_MODES = ["fp32", "1", "q2-w8a8", "q2-w4a8", "q2-w4a16"]
CALIB = ["--calib_data_num", "4", "--calib_seqlen", "32", "--no_cache"]
# stats keys whose values differ between two runs of the same command
VOLATILE = {"timestamp", "command", "pretrained_dir", "seconds", "timings", "elapsed", "platform", "torch_threads",
            "cpu", "path", "text_file", "wall_seconds", "shared_ops", "calibration_seconds", "duration",
            "unit_seconds"}  # --workers: provenance.workers.unit_seconds, the units' summed wall time
# values that hold the temporary directory's random name: the pretrained_dir array (the research
# tool's key) and the npz's sha256 over the file that holds it
IGNORED = {"pretrained_dir", "npz.sha256"}


# Number-format modes on Mamba-1 (docs/formats.md): MX, NVFP4, HiFP8, int4_g128 and fp8 weights/activations/states,
# on the fp32 and the fp16 recipe, and a per-layer table whose ranges override one another
FORMAT_MODES = {"modes": {
    "mx": {"base": "fp32", "weight_format": "mxfp4_e2m1", "act_format": "mxfp8_e4m3", "state_format": "mxfp6_e2m3"},
    "nv": {"base": "fp32", "weight_format": "nvfp4", "act_format": "fp8_e4m3", "state_format": "bf16"},
    "hif": {"base": "1", "act_format": "hifp8", "state_format": "fp16"},
    "g128": {"base": "fp32", "weight_format": "int4_g128", "act_format": "int8", "state_format": "int8_g128"},
    "mixed": {"base": "fp32", "weight_format": "fp8_e5m2",
              "layers": {"0-": {"act_format": "mxfp6_e3m2"}, "1": {"act_format": "nvfp4_noglobal",
                                                                  "state_format": "mxfp8_e5m2"}}},
}}
# Quamba2's variant knobs on Mamba-2 (docs/modes.md): x_groups, state_dtype, the quantized embedding and lm_head.
# q2-eval (lm_head=quantized, q2-w8a8's only) runs in a run without steps: with --decode or --generate it fails its
# mode at da1ad70 ("lm_head=quantized needs the lm_head:input scale": the steps' head gets no scale)
Q2_VARIANTS = {"modes": {
    "q2-v8": {"base": "q2-w8a8", "x_groups": "tensor", "state_dtype": "fp32", "embedding": "int8"},
    "q2-v4": {"base": "q2-w4a8", "embedding": "int4"},
    "q2-v16": {"base": "q2-w4a16", "embedding": "int8"},
    "q2-eval": {"base": "q2-w8a8", "embedding": "int8", "lm_head": "quantized"},
}}


def _q2_w4_ckpt(path: Path, recipe: str, head: bool) -> Path:
    """A Quamba2 W4A8 / W4A16 checkpoint of a 2-layer Mamba-2 (tests/recipes/quamba/w4/test_quamba2_w4_ckpt.py's), with head=True the
    W4O16Embedding and the recipe's W4 lm_head as well (tests/recipes/quamba/w4/test_quamba_w4head.py's)."""
    import torch
    from conftest import TOKENIZER
    from marlin_fixture import w4_config, w4_state_dict
    from w4head_fixture import VOCAB, add_w4_head

    vocab = VOCAB if head else 4096
    sd, _ = w4_state_dict([[recipe], [recipe]], vocab=vocab, size=0.01)
    cfg = w4_config([[recipe], [recipe]], vocab=vocab)
    if head:
        add_w4_head(sd, cfg, recipe)
    path.mkdir(parents=True, exist_ok=True)
    torch.save(sd, path / "pytorch_model.bin")
    (path / "config.json").write_text(json.dumps(cfg))
    shutil.copy(TOKENIZER, path / "tokenizer.json")
    return path


def _q1_w4_ckpt(path: Path, recipe: str, head: bool) -> Path:
    """A Quamba2 W4A8 / W4A16 checkpoint of a 2-layer Mamba-1 (tests/fixtures/quamba1_w4_fixture.py), with head=True the W4
    embedding and lm_head as well."""
    from quamba1_w4_fixture import w4_mamba1_config, w4_mamba1_state_dict, write_w4_mamba1
    from w4head_fixture import add_w4_head

    sd, _ = w4_mamba1_state_dict(recipe)
    cfg = w4_mamba1_config(recipe)
    if head:
        add_w4_head(sd, cfg, recipe)
    return write_w4_mamba1(path, recipe, sd, cfg)[0]


def _export(model: Path, out: Path, recipe: str) -> Path:
    """`python -m harness export` of a float model (its numbers reach the snapshot through the capture from it)."""
    from harness.cli import main

    rc = main(["export", "--model", str(model), "--output_dir", str(out), "--recipe", recipe, "--quiet", *CALIB])
    if rc != 0:
        raise RuntimeError(f"export --recipe {recipe} of {model.name} exited {rc}")
    return out


def _runs(tmp: Path) -> dict[str, list[str]]:
    from conftest import TOKENIZER, make_hf_model, write_hf_dir, write_mamba_ssm_dir
    from mamba2_fixtures import make_mamba2
    from quamba2_fixture import write_handmade_q2
    from quamba_fixture import write_handmade

    hf48 = make_hf_model(d_model=48, n_layer=3, d_state=16, seed=3)
    model = write_hf_dir(tmp / "m48", hf48)
    # seed 2: the reference-scan modes 2-4 and 3 of the default seed 0 overflow fp16 and fail their mode with a NaN
    # (exit 1, since e5dbc24 "fail a mode on NaN"); seed 2's run every mode (exit 0)
    quamba = write_handmade(tmp / "q", seed=2)
    m48_ssm = write_mamba_ssm_dir(tmp / "m48ssm", hf48)  # the same weights in mamba_ssm's layout
    # d_model 256: Marlin's per-group packing (export) needs a multiple of 128 above 128; two groups along in_proj
    m256 = write_hf_dir(tmp / "m256", make_hf_model(d_model=256, n_layer=2, d_state=16, seed=5))
    # Mamba-2: two groups, untied head; one group, tied head, d_model 256 (Marlin's per-group packing, as above)
    m2, m2g1 = tmp / "m2", tmp / "m2g1"
    make_mamba2(m2, ngroups=2, layers=2, vocab=4096, chunk=8, tie=False, seed=4, d_model=64, headdim=16)
    make_mamba2(m2g1, ngroups=1, layers=2, vocab=4096, chunk=8, tie=True, seed=6, d_model=256, headdim=32)
    for m in (m2, m2g1):
        shutil.copy(TOKENIZER, m / "tokenizer.json")
    formats, variants = tmp / "formats.json", tmp / "q2_variants.json"
    formats.write_text(json.dumps(FORMAT_MODES))
    variants.write_text(json.dumps(Q2_VARIANTS))
    ckpt = ["--layers", "all", "--taps", "all", "--seq_len", "24", "--end-to-end", "--decode", "3", *CALIB]
    decode = ["--layers", "all", "--taps", "all", "--seq_len", "24", "--decode", "4", "--generate", "4",
              "--end-to-end", *CALIB]
    return {
        "layers": ["--model", str(model), "--modes", *ALL_MODES, "--layers", "0", "1", "--taps", "all",
                   "--seq_len", "64", "--samples", "2", "--isolated", *CALIB],
        "whole": ["--model", str(model), "--modes", "fp32", "0", "2-4", "3", "--layers", "all", "--seq_len", "48",
                  "--samples", "2", "--end-to-end", "--sensitivity", *CALIB],
        "quamba": ["--model", str(quamba), "--modes", "0", "2-1", "2-4", "3", "--reference", "0", "--layers", "all",
                   "--taps", "all", "--seq_len", "48", "--end-to-end", *CALIB],
        # every built-in mode of Mamba-2 (and Quamba's eval recipe), every tap of both blocks (chunk 8: five chunks),
        # isolated, end to end
        "mamba2": ["--model", str(m2), "--modes", *M2_MODES, "q2-eval", "--modes_file", str(variants), "--layers",
                   "all", "--taps", "all", "--seq_len", "40", "--samples", "2", "--isolated", "--sensitivity", *CALIB],
        # Quamba2's W4 recipes on Mamba-1 (GPTQ on Quamba1's preparation)
        "mamba1_w4": ["--model", str(m256), "--modes", "fp32", "0", "q2-w4a8", "q2-w4a16", "--layers", "all",
                      "--taps", "all", "--seq_len", "32", "--isolated", "--sensitivity", *CALIB],
        # storage options: rotated basis, deduplicated taps, no logits arrays, the last layer by -1; four workers
        "options": ["--model", str(model), "--modes", "fp32", "1", "0", "2-2", "3", "--layers", "0", "-1", "--taps",
                    "all", "--seq_len", "32", "--samples", "2", "--isolated", "--end-to-end", "--basis", "rotated",
                    "--dedup", "--no-logits", *CALIB],
        "workers": ["--model", str(model), "--modes", "fp32", "1", "0", "2-3", "3", "--layers", "all", "--taps", "all",
                    "--seq_len", "32", "--end-to-end", "--workers", "2", *CALIB],
        # teacher-forced steps and greedy generation: float and quantized modes of each architecture
        "decode_mamba1": ["--model", str(m48_ssm), "--modes", "fp32", "1", "0", "2-1", "2-4", "3", *decode],
        "decode_mamba1_w4": ["--model", str(m256), "--modes", "fp32", "q2-w4a8", "q2-w4a16", *decode],
        "decode_mamba2": ["--model", str(m2g1), "--modes", "all", "q2-v8", "q2-v4", "q2-v16", "--modes_file",
                          str(variants), *decode],
        # number formats as recipe knobs, prefill and steps
        "formats": ["--model", str(m256), "--modes", "fp32", "mx", "nv", "hif", "g128", "mixed", "--modes_file",
                    str(formats), *decode],
        # checkpoints: every layer and tap, end to end, steps; no calibration
        "quamba2_w8a8_ckpt": ["--model", str(write_handmade_q2(tmp / "q2")), "--modes", "q2-w8a8", *ckpt],
        "quamba2_w4a8_ckpt": ["--model", str(_q2_w4_ckpt(tmp / "q2w4a8", "W4A8", head=True)), "--modes",
                              "q2-w4a8", *ckpt],
        "quamba2_w4a16_ckpt": ["--model", str(_q2_w4_ckpt(tmp / "q2w4a16", "W4A16", head=False)), "--modes",
                               "q2-w4a16", *ckpt],
        "quamba1_w4a8_ckpt": ["--model", str(_q1_w4_ckpt(tmp / "q1w4a8", "W4A8", head=False)), "--modes",
                              "q2-w4a8", *ckpt],
        "quamba1_w4a16_ckpt": ["--model", str(_q1_w4_ckpt(tmp / "q1w4a16", "W4A16", head=True)), "--modes",
                               "q2-w4a16", *ckpt],
        # the harness's own exports, run paired with their float model (fp32 and 1 from it)
        "export_quamba1": ["--model", str(_export(model, tmp / "e1", "w8a8")), "--mamba_model_path", str(model),
                           "--modes", "fp32", "1", "0", "2-1", "3", *ckpt],
        "export_mamba1_w4a8": ["--model", str(_export(m256, tmp / "e1w4", "w4a8")), "--mamba_model_path", str(m256),
                               "--modes", "fp32", "q2-w4a8", *ckpt],
        "export_quamba2": ["--model", str(_export(m2, tmp / "e2", "w8a8")), "--mamba_model_path", str(m2),
                           "--modes", "fp32", "1", "q2-w8a8", *ckpt],
        "export_quamba2_w4a16": ["--model", str(_export(m2g1, tmp / "e2w4", "w4a16")), "--mamba_model_path", str(m2g1),
                                 "--modes", "fp32", "q2-w4a16", *ckpt],
    }


def _flatten(obj, prefix: str, out: dict[str, str], tmp: str) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k not in VOLATILE:
                _flatten(v, f"{prefix}.{k}" if prefix else str(k), out, tmp)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _flatten(v, f"{prefix}[{i}]", out, tmp)
    else:
        out[prefix] = repr(obj).replace(tmp, "<tmp>").replace(str(ROOT), "<repo>")  # two checkouts compare


def _digest(npz: Path, tmp: str) -> dict:
    with np.load(npz, allow_pickle=False) as f:
        arrays = {k: f"{hashlib.sha256(f[k].tobytes()).hexdigest()[:24]}|{f[k].dtype}|{list(f[k].shape)}"
                  for k in sorted(f.files) if k != "timestamp"}
    stats: dict[str, str] = {}
    _flatten(json.loads(npz.with_name(npz.stem + "_stats.json").read_text()), "", stats, tmp)
    return {"arrays": arrays, "stats": stats}


def snapshot() -> dict:
    from harness.cli import capture_main

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        result = {}
        for name, argv in _runs(tmp_path).items():
            out = tmp_path / f"{name}.npz"
            rc = capture_main([*argv, "--output_file", str(out), "--quiet"])
            result[name] = {"rc": rc, **(_digest(out, tmp) if out.exists() else {"arrays": {}, "stats": {}})}
        return result


def compare(a: dict, b: dict) -> list[str]:
    diffs = []
    for run in sorted(set(a) | set(b)):
        if run not in a or run not in b:
            diffs.append(f"{run}: only in one snapshot")
            continue
        if a[run]["rc"] != b[run]["rc"]:
            diffs.append(f"{run}: exit {a[run]['rc']} vs {b[run]['rc']}")
        for part in ("arrays", "stats"):
            x, y = a[run][part], b[run][part]
            for key in sorted((set(x) | set(y)) - IGNORED):
                if x.get(key) != y.get(key):
                    diffs.append(f"{run} {part} {key}: {x.get(key)} != {y.get(key)}")
    return diffs


def main(argv: list[str]) -> int:
    if argv[:1] == ["--compare"] and len(argv) == 3:
        a, b = (json.loads(Path(p).read_text()) for p in argv[1:])
        diffs = compare(a, b)
        counts = {run: (len(a[run]["arrays"]), len(a[run]["stats"])) for run in a}
        print(f"runs {', '.join(f'{r} ({n} arrays, {s} stats values)' for r, (n, s) in counts.items())}")
        print("\n".join(diffs[:40]) if diffs else "identical: every array and stats value")
        return 1 if diffs else 0
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    result = snapshot()
    Path(argv[0]).write_text(json.dumps(result, indent=0, sort_keys=True))
    failed = [f"{run} (exit {r['rc']})" for run, r in result.items() if r["rc"] != 0]
    if failed:
        print(f"runs that did not exit 0: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
