"""Quamba1 W8A8 checkpoints in and out: layout against a hand-written fixture, codes used bit for bit,
round trip, the float-model pairing, and every bad checkpoint as a clear exit-2 error."""
import json
from pathlib import Path
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import ROOT, make_hf_model, write_hf_dir
from helpers import FAST_CALIB, run_cli, run_modes
from quamba_fixture import handmade_config, handmade_state_dict, write_handmade

from harness.recipes.quamba.families import calibrate_key as calibrate
from harness.checkpoints.text import DEFAULT_CALIB_FILE, calibration_windows
from harness.cli import capture_main, main
from harness.runner.export import ExportConfig, export
from harness.checkpoints.tokenizer import load_tokenizer
from harness.checkpoints.loading import open_checkpoint
from harness.kernels.quant import quantize_rows_signed_max_fp16
from harness.recipes.quamba.checkpoint import open_quamba
from harness.store.reader import load_capture
from harness.runner.weightbank import WeightBank

QUANT = ["0", "2-0", "2-1", "2-2", "2-3", "2-4", "3"]
FAST = ["--seq_len", "32", "--calib_data_num", "16", "--calib_seqlen", "64"]

# d_model 24, d_state 8 -> d_inner 48, dt_rank 2; written out from Quamba's modules (see quamba_fixture.py)
LAYER_SPEC = {
    "norm.weight": (torch.float16, (24,)), "norm.output_scale": float,
    "mixer.in_proj.weight": (torch.int8, (24, 96)), "mixer.x_proj.weight": (torch.int8, (48, 32)),
    "mixer.dt_proj.weight": (torch.int8, (2, 48)), "mixer.out_proj.weight": (torch.int8, (48, 32)),
    **{f"mixer.{n}.{k}": (torch.float32, (1, 1)) for n in ("in_proj", "x_proj", "dt_proj", "out_proj") for k in "ab"},
    **{f"mixer.{n}.alpha": float for n in ("in_proj", "x_proj", "dt_proj", "out_proj")},
    "mixer.conv1d.weight": (torch.int8, (48, 4)), "mixer.conv1d.bias": (torch.int8, (48,)),
    **{f"mixer.conv1d.{k}": float for k in ("weight_scale", "bias_scale", "input_scale", "output_scale")},
    "mixer.selective_scan.dt_bias": (torch.int8, (48,)), "mixer.selective_scan.A_log": (torch.int8, (48, 8)),
    "mixer.selective_scan.D": (torch.int8, (48,)),
    **{f"mixer.selective_scan.{k}": (torch.float32, ()) for k in (
        "dt_bias_scale", "A_scale", "D_scale", "u_scale", "dt_scale", "B_scale", "C_scale", "z_scale", "ssm_state_scale")},
    "mixer.had.x_H_scale": float,
}
TOP_SPEC = {"backbone.embedding.weight": (torch.float16, (4096, 24)), "backbone.norm_f.weight": (torch.float16, (24,)),
            "lm_head.weight": (torch.float16, (4096, 24))}


def _spec(n_layer=2):
    spec = dict(TOP_SPEC)
    for i in range(n_layer):
        spec.update({f"backbone.layers.{i}.{k}": v for k, v in LAYER_SPEC.items()})
    return spec


def _kind(v):
    return (v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else type(v)


def _load(path):
    return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)


def _capture(args, tmp_path, env=None):
    full_env = {**os.environ, "QUAMBA_HARNESS_CACHE": str(tmp_path / "cache"), **(env or {})}
    return subprocess.run([sys.executable, str(ROOT / "save_first_layer_io.py"), *map(str, args)], capture_output=True,
                          text=True, cwd=tmp_path, env=full_env, timeout=600)


@pytest.fixture(scope="module")
def exported(hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "quamba-tiny-w8a8"
    export(ExportConfig(model=hf_dir, output_dir=out, calib=FAST_CALIB, cache_dir=out.parent / "cache"),
           emit=lambda _s: None)
    return out


@pytest.fixture(scope="module")
def handmade(tmp_path_factory):
    return write_handmade(tmp_path_factory.mktemp("handmade") / "quamba-hand-w8a8")


def test_export_layout_is_quambas(exported, handmade):
    """Same keys, dtypes, shapes, strides and scalar types as the hand-written file and the spec table."""
    ours, theirs = _load(exported), _load(handmade)
    assert set(ours) == set(theirs) == set(_spec())
    for key, kind in _spec().items():
        assert _kind(ours[key]) == _kind(theirs[key]) == kind, key
        if isinstance(ours[key], torch.Tensor):
            assert ours[key].stride() == theirs[key].stride(), key  # linear weights: transposed views
    w = ours["backbone.layers.0.mixer.x_proj.weight"]
    assert w.stride() == (1, 48) and not w[:, 18:].any()  # 2 + 2*8 = 18 outputs padded to 32 with zeros
    for sd in (ours, theirs):
        b, c = (sd[f"backbone.layers.1.mixer.selective_scan.{n}_scale"] for n in "BC")
        assert b.untyped_storage().data_ptr() == c.untyped_storage().data_ptr()
    cfg = json.loads((exported / "config.json").read_text())
    assert {k: cfg[k] for k in ("norm_cfg", "embedding_cfg", "lm_head_cfg", "tie_embeddings")} == \
        {k: handmade_config()[k] for k in ("norm_cfg", "embedding_cfg", "lm_head_cfg", "tie_embeddings")}
    assert cfg["ssm_cfg"]["layer"] == "W8A8QMamba" and "is_hybrid" not in cfg and "use_cache" not in cfg
    assert (exported / "tokenizer.json").is_file()


def test_export_scales_are_the_calibrated_ones(exported, hf_dir):
    """The stored scales are the calibration's, each in the place Quamba stores it (qMambaLayer.py:838-892)."""
    ckpt = open_checkpoint(hf_dir)
    windows = calibration_windows(load_tokenizer(hf_dir), DEFAULT_CALIB_FILE, FAST_CALIB.num_samples,
                                  FAST_CALIB.seqlen, FAST_CALIB.seed)
    want = calibrate(WeightBank(ckpt), windows.ids, FAST_CALIB, 1, ckpt.prefix_hashes(1), None).scales
    sd = _load(exported)
    for i in range(2):
        p, s = f"backbone.layers.{i}.", want[i]
        assert sd[p + "norm.output_scale"] == s.s_in and sd[p + "mixer.had.x_H_scale"] == s.s_H
        assert sd[p + "mixer.conv1d.input_scale"] == s.s_xz and sd[p + "mixer.conv1d.output_scale"] == s.s_u
        scan = {k: sd[p + f"mixer.selective_scan.{k}"].item() for k in
                ("u_scale", "dt_scale", "B_scale", "C_scale", "z_scale", "ssm_state_scale")}
        assert scan == {"u_scale": s.s_u, "dt_scale": s.s_dt, "B_scale": s.s_xp, "C_scale": s.s_xp,
                        "z_scale": s.s_xz, "ssm_state_scale": s.s_h}
        assert sd[p + "mixer.in_proj.a"].item() == np.float32(s.s_in / s.s_xz)
        assert sd[p + "mixer.dt_proj.a"].item() == np.float32(s.s_xp / s.s_dt)   # dt_proj reads s_xp
        assert sd[p + "mixer.out_proj.a"].item() == s.s_H
        assert open_quamba(exported).layer_scales(i) == s
    int8 = WeightBank(ckpt).layer(0, "int8", True, "quamba")  # the built-in modes' preparation
    assert sd["backbone.layers.0.mixer.in_proj.b"].item() == int8.in_proj.scale
    assert torch.equal(sd["backbone.layers.0.mixer.in_proj.weight"].t(), int8.in_proj.codes)


def test_round_trip_is_bit_identical(exported, hf_dir, tmp_path):
    for d in "fqp":
        (tmp_path / d).mkdir()
    direct = run_modes(hf_dir, tmp_path / "f", ["fp32", "1", *QUANT], taps=["all"], layers=[0, 1])
    via = run_modes(exported, tmp_path / "q", QUANT, taps=["all"], layers=[0, 1])
    paired = run_modes(exported, tmp_path / "p", ["fp32", "1", *QUANT], taps=["all"], layers=[0, 1],
                       mamba_model_path=hf_dir)
    assert not direct.failed and not via.failed and not paired.failed
    for mode in QUANT:
        assert set(via.by_mode[mode]) == set(direct.by_mode[mode])
        for tensor, arr in direct.by_mode[mode].items():
            assert np.array_equal(via.by_mode[mode][tensor], arr), (mode, tensor)
    for mode in ("fp32", "1", *QUANT):
        for tensor, arr in direct.by_mode[mode].items():
            assert np.array_equal(paired.by_mode[mode][tensor], arr), (mode, tensor)
    assert via.stats["provenance"]["calibration"]["source"] == "checkpoint"
    pairing = paired.stats["provenance"]["model"]["pairing"]
    assert pairing["within_one_code"] == 1.0 and pairing["matched"]
    read = via.stats["provenance"]["model"]["tensors_read"]["keys"]
    assert read and all(k.startswith(("backbone.embedding", "backbone.layers.0.", "backbone.layers.1.")) for k in read)


def test_handmade_codes_and_scales_are_used_bit_for_bit(handmade, tmp_path):
    sd = handmade_state_dict()
    out = run_modes(handmade, tmp_path, QUANT, taps=["norm.out", "in_proj.out", "x_proj.out"])
    # the random codes overflow the fp16 scan output of the reference-scan modes: inf - inf in the Hadamard
    # gives NaN, which has no int8 code and fails those modes (it was cast to code 0 and passed unseen)
    nan = {m: e.get("error") for m, e in out.stats["modes"].items() if e["status"] == "error"}
    assert sorted(nan) == ["2-4", "3"] and all("NaN has no int8 code" in e for e in nan.values()), nan
    p = "backbone.layers.0."
    s_in, s_xz = sd[p + "norm.output_scale"], sd[p + "mixer.conv1d.input_scale"]
    w = sd[p + "mixer.in_proj.weight"].t()[:96].to(torch.float64).numpy()          # [out, in]
    s_w = sd[p + "mixer.in_proj.b"].item()
    arrays = out.by_mode["0"]
    q_n = np.round(arrays["L0.norm.out"].astype(np.float64) / s_in)               # codes of the norm output
    acc = q_n.reshape(-1, 24) @ w.T                                                # exact integer GEMM
    t = np.float32(np.float32(s_in / s_xz) * acc.astype(np.float32))               # in_proj epilogue, spec notes §2.6
    expect = np.clip(np.rint(np.float32(np.float32(s_w) * t)), -128, 127) * np.float32(s_xz)
    assert np.array_equal(arrays["L0.in_proj.out"].reshape(-1, 96), expect.astype(np.float32))
    assert arrays["L0.x_proj.out"].shape[-1] == 2 + 2 * 8                           # padding removed
    bank = WeightBank(None, given=open_quamba(handmade))
    layer = bank.layer(1, "int8", True, "quamba")
    assert torch.equal(layer.x_proj.codes, sd["backbone.layers.1.mixer.x_proj.weight"].t()[:18])
    assert torch.equal(layer.A_log.codes, sd["backbone.layers.1.mixer.selective_scan.A_log"])
    assert layer.conv_bias.scale == sd["backbone.layers.1.mixer.conv1d.bias_scale"]
    assert out.stats["provenance"]["calibration"]["scales"][0]["s_xp"] == float(sd[p + "mixer.selective_scan.B_scale"])
    assert out.stats["modes"]["0"]["input"]["shape"] == [1, 64, 24]


def test_w8o16_embedding_is_emulated(tmp_path):
    q = write_handmade(tmp_path / "q8e", embedding="W8O16Embedding", lm_head="W8A8B16O16Linear")
    sd = handmade_state_dict(embedding="W8O16Embedding", lm_head="W8A8B16O16Linear")
    out = run_modes(q, tmp_path, ["0"], basis="rotated")
    ids = torch.from_numpy(out.token_ids[0])
    rows = (sd["backbone.embedding.weight"][ids].to(torch.float32)
            * sd["backbone.embedding.scales"][ids].to(torch.float32)[:, None]).to(torch.float16).to(torch.float32)
    assert np.array_equal(out.by_mode["0"]["input"][0], rows.numpy())


def test_embedding_row_scale_is_the_signed_max():
    e = torch.tensor([[1.0, -2.0, 0.5, 0.25], [-1.0, -0.5, -0.25, 0.0]], dtype=torch.float16)
    codes, scales = quantize_rows_signed_max_fp16(e)
    s0 = torch.tensor(1.0, dtype=torch.float16) / 127
    assert scales.dtype == torch.float16 and scales[0] == s0
    assert codes[0].tolist() == [127, -128, 64, 32]   # -2 / s = -254 saturates at -128 (signed max, not absmax)
    assert codes[1].tolist() == [-128, -128, -128, 0]  # max 0: negatives / 0 saturate, 0 / 0 gives code 0
    # fp16 values held in fp32 are taken as fp16 (a mutant without the cast divided in fp32 and survived)
    codes32, scales32 = quantize_rows_signed_max_fp16(e.to(torch.float32))
    assert torch.equal(codes32, codes) and scales32.dtype == torch.float16 and torch.equal(scales32, scales)


def test_export_with_quantized_embedding_and_lm_head(hf_dir, tmp_path):
    """Quamba's eval.sh recipe (--quantize_embedding --quantize_lm_head): the layout of spec notes §2.7."""
    out = tmp_path / "q"
    export(ExportConfig(model=hf_dir, output_dir=out, calib=FAST_CALIB, cache_dir=tmp_path / "cache",
                        quantize_embedding=True, quantize_lm_head=True), emit=lambda _s: None)
    ours = _load(out)
    theirs = handmade_state_dict(embedding="W8O16Embedding", lm_head="W8A8B16O16Linear")
    assert set(ours) == set(theirs)
    for key in theirs:
        assert _kind(ours[key]) == _kind(theirs[key]), key
    assert ours["backbone.embedding.weight"].dtype == torch.int8 and ours["lm_head.weight"].stride() == (1, 24)
    assert type(ours["backbone.norm_f.output_scale"]) is float and ours["lm_head.a"].item() == ours["backbone.norm_f.output_scale"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["embedding_cfg"] == {"layer": "W8O16Embedding"} and cfg["lm_head_cfg"] == {"layer": "W8A8B16O16Linear"}
    q = open_quamba(out)
    rows = q.embedding().to(torch.float32)
    table = WeightBank(open_checkpoint(hf_dir)).embed(torch.arange(4096)[None], True, torch.float16, "quamba", "int8")[0]
    step = ours["backbone.embedding.scales"].to(torch.float32)[:, None]
    inside = ours["backbone.embedding.weight"] > -128  # the signed-max row scale saturates some negatives
    assert bool(((rows - table).abs() <= step)[inside].all())  # within one step of the fp16 rows elsewhere
    assert bool((~inside).any())
    r = run_modes(out, tmp_path, ["0"])
    assert not r.failed


def _capture_here(args, cwd, monkeypatch, capsys) -> tuple[int, str]:
    """The script's entry (capture_main under its name) in-process, as _capture runs it: (exit code, stderr). For the
    refusals before any work; the script in a subprocess: test_research_command_line_and_shell_variables and
    test_mismatched_pair_warns_and_dims_must_match."""
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("QUAMBA_HARNESS_CACHE", str(cwd / "cache"))
    rc = run_cli(lambda argv: capture_main(argv, prog="save_first_layer_io.py"), args)
    return rc, capsys.readouterr().err


def test_fp32_without_the_float_model_is_a_clear_error(handmade, tmp_path, monkeypatch, capsys):
    rc, err = _capture_here(["--model", handmade, "--modes", "fp32", "0", *FAST], tmp_path, monkeypatch, capsys)
    assert rc == 2 and "need the float model" in err and "--mamba_model_path" in err
    assert "Traceback" not in err and not list(tmp_path.glob("*.npz"))


def test_prep_exact_on_a_checkpoint_needs_the_float_model(handmade, tmp_path, monkeypatch, capsys):
    """A checkpoint holds prep=quamba's codes: a prep=exact int8 mode must not silently run them."""
    modes = tmp_path / "modes.json"
    modes.write_text('{"modes": {"0x": {"base": "0", "prep": "exact"}}}')
    out = tmp_path / "out"
    out.mkdir()
    rc, err = _capture_here(["--model", handmade, "--modes_file", modes, "--modes", "0x", *FAST], out, monkeypatch,
                            capsys)
    assert rc == 2 and "0x need the float model" in err and "prep=exact" in err
    assert "Traceback" not in err and not list(out.glob("*.npz"))


def test_research_command_line_and_shell_variables(exported, hf_dir, tmp_path):
    r = _capture(["--pretrained_dir", exported.parent, "--model", exported.name, "--mamba_model_path", hf_dir,
                  "--modes", "fp32", "0", "2-1", *FAST], tmp_path)
    assert r.returncode == 0, r.stderr
    stats = json.loads((tmp_path / "first_layer_io_all_modes_stats.json").read_text())
    assert stats["schema_version"] == 3
    for mode in ("fp32", "0", "2-1"):  # the research tool's post-analysis layout
        for t in ("input", "output"):
            assert set(stats["modes"][mode][t]) == {"shape", "first_10", "mean", "std", "min", "max"}
            assert stats["modes"][mode][t]["mean"] == stats["modes"][mode]["tensors"][t]["mean"]
    env = {"PYTHON": sys.executable, "PRETRAINED_DIR": str(exported.parent), "MODEL": exported.name,
           "MAMBA_MODEL_PATH": str(hf_dir.parent), "OUTPUT_FILE": str(tmp_path / "w.npz"), "SEQ_LEN": "32",
           "QUAMBA_HARNESS_CACHE": str(tmp_path / "cache")}
    # MAMBA_MODEL_PATH as the research script has it: the parent; the model is found as <parent>/<name>
    link = hf_dir.parent / "mamba-tiny"
    if not link.exists():
        link.symlink_to(hf_dir)
    env["MODEL"] = "quamba-tiny-w8a8"
    s = subprocess.run(["bash", str(ROOT / "capture_first_layer.sh"), "fp32", "0"], capture_output=True, text=True,
                       env={**os.environ, **env}, cwd=tmp_path, timeout=600)
    assert s.returncode == 0, s.stderr
    with np.load(tmp_path / "w.npz") as z:
        assert {"mode_fp32_output", "mode_0_output"} <= set(z.files)


def test_mismatched_pair_warns_and_dims_must_match(exported, tmp_path):
    other = write_hf_dir(tmp_path / "other", make_hf_model(seed=1))
    r = _capture(["--model", exported, "--mamba_model_path", other, "--modes", "fp32", "0", *FAST], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "probably do not belong together" in r.stderr
    pairing = json.loads((tmp_path / "first_layer_io_all_modes_stats.json").read_text())["provenance"]["model"]["pairing"]
    assert not pairing["matched"] and pairing["within_one_code"] < 0.9
    wider = write_hf_dir(tmp_path / "wider", make_hf_model(d_model=32))
    (tmp_path / "w").mkdir()
    r = _capture(["--model", exported, "--mamba_model_path", wider, "--modes", "fp32", *FAST], tmp_path / "w")
    assert r.returncode == 2 and "does not belong to" in r.stderr and "d_model 32 vs 24" in r.stderr


def _mutate(key, value):
    def apply(sd, cfg):
        if value is None:
            del sd[key]
        else:
            sd[key] = value(sd[key])
    return apply


def _config(**changes):
    def apply(sd, cfg):
        for k, v in changes.items():
            if k == "ssm_layer":
                cfg["ssm_cfg"]["layer"] = v
            else:
                cfg[k] = v
    return apply


@pytest.mark.parametrize("change, message", [
    (_mutate("backbone.layers.1.mixer.conv1d.output_scale", None),
     "'backbone.layers.1.mixer.conv1d.output_scale' is missing; it must be a Python float"),
    (_mutate("backbone.layers.0.mixer.x_proj.weight", lambda w: w[:, :18]),
     "'backbone.layers.0.mixer.x_proj.weight' is a int8 tensor of shape [48, 18], expected a int8 tensor of shape [48, 32]"),
    (_mutate("backbone.layers.0.mixer.in_proj.weight", lambda w: w.to(torch.float16)),
     "'backbone.layers.0.mixer.in_proj.weight' is a float16 tensor"),
    (_mutate("backbone.layers.0.norm.output_scale", lambda v: torch.tensor(v)),
     "'backbone.layers.0.norm.output_scale' is a float32 tensor of shape [], expected a Python float"),
    (_mutate("backbone.layers.0.mixer.selective_scan.A_scale", lambda v: float(v)),
     "'backbone.layers.0.mixer.selective_scan.A_scale' is a float, expected an fp32 0-dim tensor"),
    (_mutate("backbone.layers.0.mixer.selective_scan.z_scale", lambda v: v * 2),
     "conv1d.input_scale"),
    # read as Quamba2's W4A8 Mamba-1 checkpoint (recipes.quamba.w4.checkpoint_mamba1), whose Marlin linears need d_model > 128
    (_config(ssm_layer="W4A8QMamba"), "d_model 24 (Marlin packs a linear of 128 or fewer in-features per channel"),
    (_config(ssm_layer="W8A8QMamba2"), "config.json (Quamba2): sizes must be positive"),  # read as Quamba2's
    (_config(is_hybrid=True), "a hybrid"),
    (_config(embedding_cfg={"layer": "W4O16Embedding"}), "embedding_cfg.layer 'W4O16Embedding' is not supported"),
    # added for surviving mutants: the norm's name in the message; a scale tensor of the right shape, wrong dtype
    (_config(norm_cfg={"norm": "LayerNorm"}), "norm_cfg.norm 'LayerNorm'"),
    (_mutate("backbone.layers.0.mixer.selective_scan.A_scale", lambda v: v.to(torch.float64)),
     "'backbone.layers.0.mixer.selective_scan.A_scale' is a float64 tensor of shape [], expected an fp32 0-dim tensor"),
])
def test_bad_checkpoints_are_clear_errors(tmp_path, capsys, change, message):
    sd, cfg = handmade_state_dict(), handmade_config()
    change(sd, cfg)
    q = write_handmade(tmp_path / "bad", sd=sd, config=cfg)
    out = tmp_path / "out.npz"
    assert capture_main(["--model", str(q), "--modes", "0", "--output_file", str(out), "--no_cache", *FAST]) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.glob("*.npz")) and not list(tmp_path.glob("*_stats.json"))


def test_export_never_overwrites(hf_dir, tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert main(["export", "--model", str(hf_dir), "--output_dir", str(tmp_path / "full"), "--no_cache"]) == 2
    assert "is not an empty directory" in capsys.readouterr().err
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    assert main(["export", "--model", str(tmp_path / "nowhere"), "--output_dir", str(tmp_path / "new")]) == 2
    assert "does not exist" in capsys.readouterr().err and not (tmp_path / "new").exists()



@pytest.mark.parametrize("failure,text", [
    (OSError(28, "No space left on device"), "No space left on device"),
    (RuntimeError("[enforce fail at inline_container.cc:626] . PytorchStreamWriter failed writing file data/3: "
                  "file write failed"), "PytorchStreamWriter failed writing file data/3: file write failed"),
])
def test_export_on_a_full_disk_is_one_line_and_leaves_nothing(hf_dir, tmp_path, capsys, monkeypatch, failure, text):
    """torch.save failing half-way (a full disk): exit 2, one line naming the directory and the errno text, no
    temporary directory, no output directory (before, a torch.save traceback)."""
    import harness.recipes.quamba.checkpoint as ckpt_mod

    def full_disk(obj, path):
        Path(path).write_bytes(b"PK\x03\x04 half")
        raise failure
    monkeypatch.setattr(ckpt_mod.torch, "save", full_disk)
    out = tmp_path / "exp" / "q"
    out.parent.mkdir()
    rc = main(["export", "--model", str(hf_dir), "--output_dir", str(out), "--no_cache",
               "--calib_data_num", "4", "--calib_seqlen", "16", "--calib_batch_size", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and f"cannot write {out}: {text}; nothing was left behind" in err
    assert "Traceback" not in err and len([ln for ln in err.splitlines() if "cannot write" in ln]) == 1
    assert list(out.parent.iterdir()) == []


def test_version_1_stats_files_are_still_read(tmp_path):
    from harness.store.format import stats_path, write_npz
    write_npz(tmp_path / "v1.npz", {"mode_0_output": np.zeros((1, 2, 3), np.float32)})
    stats_path(tmp_path / "v1.npz").write_text(json.dumps({"schema_version": 1, "aliases": {}, "modes": {
        "0": {"status": "ok", "tensors": {"output": {"point": "L0.block.out"}}}}}))
    cf = load_capture(tmp_path / "v1.npz")
    assert cf.modes() == ["0"] and cf.array("0", "output").shape == (1, 2, 3)


def test_tokenizer_comes_from_the_float_model_when_the_checkpoint_has_none(exported, hf_dir, tmp_path):
    import shutil
    bare = tmp_path / "bare"
    shutil.copytree(exported, bare)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).unlink(missing_ok=True)
    r = run_modes(bare, tmp_path, ["fp32", "0"], mamba_model_path=hf_dir)
    assert not r.failed and r.stats["provenance"]["tokenizer"]["path"] == str(hf_dir / "tokenizer.json")


def test_pairing_checked_beside_tokenizing_is_the_direct_check(exported, tmp_path, monkeypatch):
    """The pipeline runs check_pair in a thread while it tokenizes: same result as a direct call, and its
    error still ends the run before any file is written."""
    import harness.runner.pipeline as pipeline
    from harness.checkpoints.loading import ModelDirError
    from harness.runner.pairing import check_pair, open_models

    other = write_hf_dir(tmp_path / "other", make_hf_model(seed=1))
    out = run_modes(exported, tmp_path, ["fp32", "0"], layers=[0, 1], mamba_model_path=other)
    assert out.stats["provenance"]["model"]["pairing"] == check_pair(open_models(exported, other), 1)

    def broken(models, depth):
        raise ModelDirError("layer 0 in_proj: the checkpoint has shape [1], the float model [2]")
    monkeypatch.setattr(pipeline, "check_pair", broken)
    (tmp_path / "e").mkdir()
    with pytest.raises(ModelDirError, match="in_proj"):
        run_modes(exported, tmp_path / "e", ["fp32", "0"], mamba_model_path=other)
    assert list((tmp_path / "e").iterdir()) == []


def test_prefix_hashes_cover_the_scales(tmp_path):
    """Two checkpoints that differ in one scale (a Python float) hash differently from that layer on (a mutant
    that hashed repr(None) for every non-tensor value survived: the provenance would not tell them apart)."""
    from harness.recipes.quamba.checkpoint import open_quamba

    sd = handmade_state_dict()
    a = write_handmade(tmp_path / "a", sd=dict(sd))
    key = "backbone.layers.1.norm.output_scale"   # a scale stored once (no twin that must agree)
    sd[key] = sd[key] * 2
    b = write_handmade(tmp_path / "b", sd=sd)
    ha, hb = open_quamba(a).prefix_hashes(1), open_quamba(b).prefix_hashes(1)
    assert ha[0] == hb[0] and ha[1] != hb[1]


def test_every_field_of_a_layer_is_the_checkpoints_code_and_scale(handmade):
    """int8_layer hands over every stored int8 tensor with its own scale (mutants that dropped the scan
    parameters' scales, read dt_bias from another key or the conv bias from a missing one survived: only the
    slower round trip caught them)."""
    sd = handmade_state_dict()
    layer = open_quamba(handmade).int8_layer(1)
    p = "backbone.layers.1.mixer."
    outs = {"in_proj": 96, "x_proj": 18, "dt_proj": 48, "out_proj": 24}
    for name, d_out in outs.items():
        q = getattr(layer, name)
        assert torch.equal(q.codes, sd[f"{p}{name}.weight"].t()[:d_out]) and q.scale == sd[f"{p}{name}.b"].item(), name
    conv = {"conv_weight": ("weight", "weight_scale"), "conv_bias": ("bias", "bias_scale")}
    for field, (key, scale) in conv.items():
        q = getattr(layer, field)
        assert torch.equal(q.codes, sd[f"{p}conv1d.{key}"]) and q.scale == sd[f"{p}conv1d.{scale}"], field
    scan = {"dt_bias": "dt_bias_scale", "A_log": "A_scale", "D": "D_scale"}
    for field, scale in scan.items():
        q = getattr(layer, field)
        assert torch.equal(q.codes, sd[f"{p}selective_scan.{field}"]), field
        assert q.scale == sd[f"{p}selective_scan.{scale}"].item(), field
    assert len({layer.dt_bias.scale, layer.A_log.scale, layer.D.scale}) == 3  # the fixture's scales differ


def _write_config(path, **cfg):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"d_model": 24, "n_layer": 2, "vocab_size": 4096, **cfg}))
    return path


def test_any_one_quamba_marker_makes_a_quamba_directory(tmp_path):
    """Quamba's config can carry only one of its markers (a hybrid one sets is_hybrid, an older one has no
    lm_head_cfg): each alone routes the directory to the Quamba reader (whose errors then name what is not
    supported); a mutant that required both norm_cfg and lm_head_cfg, or read a key other than is_hybrid,
    survived and would have read such a checkpoint as a float model."""
    from harness.recipes.quamba.checkpoint import is_quamba_dir
    markers = {"layer": {"ssm_cfg": {"layer": "W8A8QMamba"}}, "hybrid_layers": {"ssm_cfg": {"layer": ["W8A8QMamba"]}},
               "norm": {"norm_cfg": {"norm": "QRMSNorm"}}, "lm_head": {"lm_head_cfg": {"layer": "Linear"}},
               "hybrid": {"is_hybrid": True}}
    for name, cfg in markers.items():
        assert is_quamba_dir(_write_config(tmp_path / name, **cfg)), name
    assert not is_quamba_dir(_write_config(tmp_path / "float", ssm_cfg={"d_state": 16}, is_hybrid=False))
    assert not is_quamba_dir(tmp_path / "nowhere")


def test_a_config_without_embedding_or_lm_head_cfg_reads_as_quambas_defaults(tmp_path):
    """Quamba builds an Embedding and a Linear lm_head where the config names none (quamba_mixer_seq.py:290,
    412): such a checkpoint opens (a mutant that defaulted the lm_head to None rejected it as unsupported)."""
    cfg = handmade_config()
    del cfg["embedding_cfg"], cfg["lm_head_cfg"]
    q = open_quamba(write_handmade(tmp_path / "q", config=cfg))
    assert q.kinds == {"embedding": "Embedding", "lm_head": "Linear"}
    weight, s_in, alpha = q.lm_head()
    assert torch.equal(weight, handmade_state_dict()["lm_head.weight"].to(torch.float32)) and s_in is alpha is None


def test_a_checkpoint_saved_from_the_gpu_opens_memory_mapped(tmp_path, monkeypatch):
    """Quamba saves its tensors from cuda:0 (spec notes §2.7): on a CPU they open with map_location="cpu" in the
    first, memory-mapped load (a mutant without map_location fell back to reading the whole file; the
    fixture's CPU tensors could not tell)."""
    import torch.serialization as ser
    cuda_tag = (0, lambda storage: "cuda:0", lambda storage, location: None)
    monkeypatch.setattr(ser, "_package_registry", [cuda_tag, *ser._package_registry])
    q = write_handmade(tmp_path / "gpu")
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="CUDA"):
        torch.load(q / "pytorch_model.bin", weights_only=True)      # the file really names a CUDA device
    calls, load = [], torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(k) or load(*a, **k))
    layer = open_quamba(q).int8_layer(0)
    assert [c.get("mmap") for c in calls] == [True]
    assert torch.equal(layer.D.codes, handmade_state_dict()["backbone.layers.0.mixer.selective_scan.D"])


def test_a_legacy_format_checkpoint_opens_and_records_the_bytes_read(tmp_path):
    """torch.save's legacy (non-zip) format cannot be memory-mapped and is read whole instead (a mutant that
    loaded None there survived); tensors_read holds each tensor's size in bytes (a mutant recorded None)."""
    sd = handmade_state_dict()
    q = write_handmade(tmp_path / "legacy", sd=sd)
    torch.save(sd, q / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    ckpt = open_quamba(q)
    ckpt.int8_layer(1)
    key = "backbone.layers.1.mixer.in_proj.weight"
    assert ckpt.tensors_read[key] == 24 * 96 and ckpt.tensors_read["backbone.layers.1.norm.weight"] == 24 * 2
    assert all(k.startswith("backbone.layers.1.") for k in ckpt.tensors_read)


def test_round_trip_end_to_end_logits_are_bit_identical(exported, hf_dir, tmp_path):
    """The exported lm_head (norm_f folded, rotated, fp16) gives the logits the float model gives in mode 0
    (a mutant that handed the checkpoint's fp16 lm_head on without its fp32 cast survived every layer test)."""
    for d in "fq":
        (tmp_path / d).mkdir()
    direct = run_modes(hf_dir, tmp_path / "f", ["0", "2-4"], layers=[0, 1], end_to_end=True)
    via = run_modes(exported, tmp_path / "q", ["0", "2-4"], layers=[0, 1], end_to_end=True)
    assert not direct.failed and not via.failed
    for mode in ("0", "2-4"):
        assert np.array_equal(via.by_mode[mode]["logits"], direct.by_mode[mode]["logits"]), mode


def _write_back(src, dst):
    """Read a Quamba directory with open_quamba and write what it read with write_quamba (as export hands it)."""
    from harness.recipes.quamba.checkpoint import write_quamba

    q = open_quamba(src)
    n = q.dims.n_layer
    embedding = {k: v for k, v in q._sd.items() if k.startswith("backbone.embedding.")}
    weight, s_in, _alpha = q.lm_head()
    lm_head = weight if s_in is not None else weight.to(torch.float16)  # write_quamba takes an fp16 float head
    dst.mkdir()
    write_quamba(dst, q.dims, json.loads((src / "config.json").read_text()), [q.int8_layer(i) for i in range(n)],
                 [q.layer_scales(i) for i in range(n)], embedding=embedding, lm_head=lm_head, lm_head_input_scale=s_in)
    return dst


def _assert_same_state_dict(ours, theirs):
    assert list(ours) == list(theirs)  # same keys in Quamba's state-dict order
    for key, want in theirs.items():
        got = ours[key]
        assert type(got) is type(want), key
        if isinstance(want, torch.Tensor):
            assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride()), key
            assert torch.equal(got, want), key
        else:
            assert got == want, key


@pytest.mark.parametrize("embedding, lm_head", [("Embedding", "Linear"), ("W8O16Embedding", "W8A8B16O16Linear")])
def test_a_handmade_checkpoint_written_back_is_the_same_checkpoint(tmp_path, embedding, lm_head):
    """open_quamba then write_quamba reproduces Quamba's own files: every entry's type, dtype, shape, stride and
    value (the a/alpha epilogue factors of each W8A8 linear, a layer's own norm weight, the conv bias scale) and
    config.json to the byte (Quamba's json.dump(..., indent=4), quamba_mixer_seq.py:449). Mutants that wrote
    alpha as s_w / s_in (linear_entries 21) or s_w * s_in * s_out, s_w / s_in / s_out (24, 25), x_proj
    without its output scale (layer_entries 55), ones or an fp32 tensor for a norm weight (4, 10), 1.0 for a
    stored conv bias scale (44, 46), config.json without or with another indent (write_quamba 48, 50, 51), or a
    quantized lm_head without its weight scale (lm_head 11) survived."""
    sd = handmade_state_dict(embedding=embedding, lm_head=lm_head)
    g = torch.Generator().manual_seed(3)
    sd["backbone.layers.1.norm.weight"] = (0.5 + torch.rand(24, generator=g)).to(torch.float16)  # not folded
    src = write_handmade(tmp_path / "src", sd=sd, embedding=embedding, lm_head=lm_head)
    if lm_head == "W8A8B16O16Linear":
        codes, s_in, alpha = open_quamba(src).lm_head()
        assert torch.equal(codes.codes, sd["lm_head.weight"].t()) and codes.scale == sd["lm_head.b"].item()
        assert (s_in, alpha) == (sd["backbone.norm_f.output_scale"], sd["lm_head.alpha"])
    dst = _write_back(src, tmp_path / "dst")
    ours = _load(dst)
    _assert_same_state_dict(ours, sd)
    b, c = (ours[f"backbone.layers.0.mixer.selective_scan.{n}_scale"] for n in "BC")
    assert b.untyped_storage().data_ptr() == c.untyped_storage().data_ptr()  # one storage, as Quamba saves it
    assert (dst / "config.json").read_text() == (src / "config.json").read_text()


def test_a_conv_without_bias_is_written_with_bias_scale_one(tmp_path):
    """Quamba's QCausalConv1D.from_fp16 stores bias_scale 1.0 and no bias tensor for a conv without bias
    (qConvLayer.py:70-72); written back, such a checkpoint is the same again (a mutant that read the missing
    bias's scale crashed, layer_entries 43; one that wrote 2.0 survived, 45)."""
    sd = handmade_state_dict()
    for i in range(2):
        del sd[f"backbone.layers.{i}.mixer.conv1d.bias"]
        sd[f"backbone.layers.{i}.mixer.conv1d.bias_scale"] = 1.0
    src = write_handmade(tmp_path / "src", sd=sd)
    assert open_quamba(src).int8_layer(0).conv_bias is None
    _assert_same_state_dict(_load(_write_back(src, tmp_path / "dst")), sd)
