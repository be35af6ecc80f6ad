"""Mamba-2 in floating point: both checkpoint layouts, the fp32 mode against transformers' own
Mamba2ForCausalLM (torch path) per layer and for the logits, the SSD and gated norm ops against
their references, the site table, and Mamba-1-only modes refused."""
from __future__ import annotations

import json

import pytest
import torch

from harness.checkpoints.loading import ModelDirError, open_checkpoint
from harness.runner.backbone import build_backbone
from harness.emulation.capture import MAMBA2_POINTS, TapError, capture, points_of, select_points
from harness.kernels.ssd import gated_rmsnorm, gated_rmsnorm_ref, ssd_chunked, ssd_dt, ssd_ref
from harness.modes import ModeError
from harness.recipes.registry import get_mode, resolve_modes
from harness.runner.forwards import _to_original, build_head
from harness.runner.weightbank import WeightBank

from mamba2_fixtures import make_mamba2, ssd_float64, to_mamba_ssm_layout

SEQ = 21  # chunk_size 8: two chunk boundaries inside the sample, and a partial last chunk


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module", params=[(1, True), (2, False)], ids=["ngroups1-tied", "ngroups2-untied"])
def model(request, tmp_path_factory):
    ngroups, tie = request.param
    out = tmp_path_factory.mktemp(f"m2g{ngroups}")
    hf = make_mamba2(out / "tf", ngroups=ngroups, tie=tie, layers=3, seed=ngroups)
    to_mamba_ssm_layout(out / "tf", out / "ssm")
    return hf, out


def _transformers_run(hf, ids):
    """Per layer: the mixer output and the residual after the block; and the logits."""
    mixers, blocks = [], []
    hooks = [layer.mixer.register_forward_hook(lambda m, i, o: mixers.append(o.detach())) for layer in hf.backbone.layers]
    hooks += [layer.register_forward_hook(lambda m, i, o: blocks.append(o.detach())) for layer in hf.backbone.layers]
    with torch.no_grad():
        logits = hf(ids).logits
    for h in hooks:
        h.remove()
    return mixers, blocks, logits


def _harness_run(path, mode: str, ids, ssm_impl: str | None = None):
    from dataclasses import replace
    recipe = get_mode(mode) if ssm_impl is None else replace(get_mode(mode), ssm_impl=ssm_impl)
    ckpt = open_checkpoint(path)
    bank = WeightBank(ckpt)
    n = ckpt.dims.n_layer
    backbone = build_backbone(recipe, bank, None, n - 1)
    names = [f"L{i}.{p}" for i in range(n) for p in ("block.out", "block.residual")]
    with capture(backbone, names) as cap:
        residual = backbone(ids)
    rot = recipe.rotate == "yes"
    mixers = [_to_original(cap[f"L{i}.block.out"].values, rot) for i in range(n)]
    blocks = [_to_original(cap[f"L{i}.block.residual"].values, rot) for i in range(n)]
    return ckpt, mixers, blocks, build_head(recipe, bank)(residual)


@pytest.mark.parametrize("ssm_impl", ["reference", "kernel"])
def test_fp32_equals_transformers_per_layer_and_logits(model, ssm_impl):
    hf, out = model
    ids = torch.randint(0, 64, (1, SEQ), generator=torch.Generator().manual_seed(5))
    t_mix, t_block, t_logits = _transformers_run(hf, ids)
    ckpt, mix, block, logits = _harness_run(out / "tf", "fp32", ids, ssm_impl)
    assert ckpt.dims.architecture == "mamba2" and ckpt.dims.chunk_size == 8 < SEQ
    for i in range(ckpt.dims.n_layer):
        assert rel(mix[i], t_mix[i]) <= 1e-5, (i, rel(mix[i], t_mix[i]))
        assert rel(block[i], t_block[i]) <= 1e-5
    assert rel(logits, t_logits) <= 1e-5


def test_mamba_ssm_layout_is_the_same_model(model):
    hf, out = model
    a, b = open_checkpoint(out / "tf"), open_checkpoint(out / "ssm")
    assert (a.format, b.format) == ("transformers", "mamba_ssm") and a.dims == b.dims
    assert a.prefix_hashes(2) == b.prefix_hashes(2)  # canonical names: both layouts hash alike
    ids = torch.randint(0, 64, (1, SEQ), generator=torch.Generator().manual_seed(6))
    _, mix_a, _, logits_a = _harness_run(out / "tf", "fp32", ids)
    _, mix_b, _, logits_b = _harness_run(out / "ssm", "fp32", ids)
    assert all(torch.equal(x, y) for x, y in zip(mix_a, mix_b)) and torch.equal(logits_a, logits_b)


def test_fp16_mode_runs_close_to_fp32(model):
    hf, out = model
    ids = torch.randint(0, 64, (1, SEQ), generator=torch.Generator().manual_seed(7))
    _, t_block, t_logits = _transformers_run(hf, ids)
    _, _, block, logits = _harness_run(out / "tf", "1", ids)
    assert 0 < rel(logits, t_logits) < 2e-2  # fp16 rounding: not exact, but close
    assert torch.equal(torch.tensor(block[0].shape), torch.tensor(t_block[0].shape))


def _ssd_inputs(seed: int, L: int = 19, h: int = 6, g: int = 3):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, L, h, 4, generator=gen)
    dt = ssd_dt(torch.randn(2, L, h, generator=gen), torch.randn(h, generator=gen))
    A_log = torch.rand(h, generator=gen) * 2 - 0.5
    B, C = torch.randn(2, L, g, 5, generator=gen), torch.randn(2, L, g, 5, generator=gen)
    return x, dt, A_log, B, C, torch.randn(h, generator=gen)


@pytest.mark.parametrize("chunk", [1, 4, 7, 19, 32])
def test_ssd_chunked_and_sequential_match_float64(chunk):
    args = _ssd_inputs(chunk)
    y64, s64 = ssd_float64(*args)
    y_ref, s_ref = ssd_ref(*args)
    y_chk, s_chk = ssd_chunked(*args, chunk_size=chunk)
    assert rel(y_ref, y64) < 1e-6 and rel(s_ref, s64) < 1e-6
    assert rel(y_chk, y64) < 1e-6 and rel(s_chk, s64) < 1e-6


def test_ssd_softplus_dt():
    dt = ssd_dt(torch.tensor([[[-30.0, 0.0, 25.0]]]), torch.tensor([0.0, 1.0, 0.0]))
    assert torch.allclose(dt, torch.nn.functional.softplus(torch.tensor([[[-30.0, 1.0, 25.0]]])), rtol=1e-6)


@pytest.mark.parametrize("ngroups", [1, 2, 4])
def test_gated_rmsnorm_is_groupwise(ngroups):
    gen = torch.Generator().manual_seed(ngroups)
    y, z, w = torch.randn(2, 5, 16, generator=gen), torch.randn(2, 5, 16, generator=gen), torch.randn(16, generator=gen)
    got = gated_rmsnorm(y, z, w, ngroups, 1e-5)
    assert rel(got, gated_rmsnorm_ref(y, z, w, ngroups, 1e-5)) < 1e-6
    if ngroups > 1:  # one norm over the whole width is another function
        assert rel(got, gated_rmsnorm_ref(y, z, w, 1, 1e-5)) > 1e-3


def test_site_table_and_taps():
    assert points_of("mamba2") is MAMBA2_POINTS
    for p in ("in_proj.z", "in_proj.xBC", "in_proj.dt", "conv1d.x", "conv1d.B", "conv1d.C", "ssd.dt", "ssd.y",
              "ssd.state", "gnorm.out", "out_proj.out"):
        assert p in MAMBA2_POINTS
    chosen = select_points([1], ["all"], MAMBA2_POINTS)
    assert chosen[0] == "L1.block.in" and chosen[-1] == "L1.block.residual" and "L1.ssd.y" in chosen
    assert chosen.index("L1.in_proj.z") < chosen.index("L1.conv1d.x") < chosen.index("L1.ssd.y") \
        < chosen.index("L1.gnorm.out") < chosen.index("L1.out_proj.out")
    with pytest.raises(TapError, match="ssm.u"):  # a Mamba-1 site on a Mamba-2 model
        select_points([0], ["ssm.u"], MAMBA2_POINTS)


def test_captured_parts_are_the_mixers_tensors(model):
    hf, out = model
    ids = torch.randint(0, 64, (1, SEQ), generator=torch.Generator().manual_seed(8))
    ckpt = open_checkpoint(out / "tf")
    backbone = build_backbone(get_mode("fp32"), WeightBank(ckpt), None, 0)
    names = [f"L0.{p}" for p in MAMBA2_POINTS if p != "had.out"]
    with capture(backbone, names) as cap:
        backbone(ids)
    d = ckpt.dims
    assert cap["L0.in_proj.xBC"].values.shape == (1, SEQ, d.conv_dim)
    assert cap["L0.ssd.state"].values.shape == (1, d.nheads, d.headdim, d.d_state)
    assert torch.all(cap["L0.ssd.dt"].values > 0)
    expect = gated_rmsnorm(cap["L0.ssd.y"].values, cap["L0.in_proj.z"].values, ckpt.raw_layer(0)["gnorm_weight"],
                           d.ngroups, d.gnorm_eps)
    assert torch.equal(cap["L0.gnorm.out"].values, expect)


def test_mamba1_only_modes_are_refused_on_mamba2():
    assert [r.name for r in resolve_modes(["all"], architecture="mamba2")] == ["fp32", "1", "q2-w8a8", "q2-w4a8",
                                                                               "q2-w4a16"]
    assert [r.name for r in resolve_modes(["essential"], architecture="mamba2")] == ["fp32", "1", "q2-w8a8"]
    with pytest.raises(ModeError, match=r"mode '2-1' does not run on a mamba2 model.*valid there: fp32, 1, q2-w8a8"):
        resolve_modes(["fp32", "2-1"], architecture="mamba2")
    assert len(resolve_modes(["all"])) == 8  # Mamba-1 unchanged


def test_bad_mamba2_checkpoints(model, tmp_path):
    _, out = model
    cfg = json.loads((out / "ssm" / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "pytorch_model.bin").symlink_to(out / "ssm" / "pytorch_model.bin")
    for change, message in ((lambda c: c["ssm_cfg"].update(headdim=7), "nheads \\* headdim"),
                            (lambda c: c["ssm_cfg"].update(ngroups=4), "in_proj.weight has shape"),
                            (lambda c: c.update(d_intermediate=64), "d_intermediate"),
                            (lambda c: c["ssm_cfg"].update(dt_limit=[0.0, 1.0]), "dt_limit")):
        c = json.loads(json.dumps(cfg))
        change(c)
        (bad / "config.json").write_text(json.dumps(c))
        with pytest.raises(ModelDirError, match=message):
            open_checkpoint(bad)


def test_mamba2_takes_weight_and_act_formats_and_refuses_state_format(tmp_path):
    """weight_format and act_format run on Mamba-2 blocks (architectures.mamba2.build); state_format is Mamba-1's
    only: on a Mamba-2 model such a mode is a clear ModeError naming the knob, not a run that ignores it."""
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"modes": {"mx": {"base": "fp32", "act_format": "mxfp8_e4m3"},
                                       "st": {"base": "fp32", "layers": {"1-": {"state_format": "bf16"}}}}}))
    assert [r.name for r in resolve_modes(["fp32", "mx", "st"], f)] == ["fp32", "mx", "st"]  # Mamba-1: all run
    assert [r.name for r in resolve_modes(["fp32", "mx"], f, architecture="mamba2")] == ["fp32", "mx"]
    with pytest.raises(ModeError, match=r"mode 'st' does not run on a mamba2 model: state_format is applied to "
                                        r"Mamba-1 blocks only"):
        resolve_modes(["fp32", "st"], f, architecture="mamba2")


def test_the_fp16_model_holds_A_log_in_fp16_and_D_in_fp32(model):
    """mamba_ssm's Mamba2 creates A_log in the model's dtype and D in fp32 (enyac-group/mamba f034308
    mamba_ssm/modules/mamba2.py:131-137), and the checkpoint's values are copied in uncast: Quamba's fp16 model
    (mode 1, Quamba2's calibration model and its int8 A_log) holds fp16 A_log and full-precision D."""
    from harness.architectures.mamba2.weights import float_layer_mamba2

    _, out = model
    raw = WeightBank(open_checkpoint(out / "tf")).raw(0)
    assert not torch.equal(raw["A_log"].to(torch.float16).float(), raw["A_log"].float())  # not fp16 already
    fp16, fp32 = float_layer_mamba2(raw, True, torch.float16), float_layer_mamba2(raw, True, torch.float32)
    assert torch.equal(fp16.A_log, raw["A_log"].to(torch.float16).float())
    assert torch.equal(fp32.A_log, raw["A_log"].float())
    assert torch.equal(fp16.D, raw["D"].float()) and torch.equal(fp32.D, raw["D"].float())


@pytest.fixture(scope="module")
def m2_dirs(tmp_path_factory):
    """One small Mamba-2 model in both layouts (its tokenizer is never reached: config.json is refused first)."""
    out = tmp_path_factory.mktemp("m2cfg")
    make_mamba2(out / "tf", layers=1, seed=3)
    to_mamba_ssm_layout(out / "tf", out / "ssm")
    return out


HUGE = "1" * 5000  # over Python's int-string limit (4300 digits)
BAD_CONFIGS = [  # (case, layout, edit of config.json (or a text replacement), fragment of the message)
    ("n_groups-inf", "tf", {"n_groups": float("inf")}, "'n_groups' must be an integer (a JSON number such as 2"),
    ("expand-inf", "tf", {"expand": float("inf")}, "'expand' must be an integer"),
    ("architectures-int", "tf", {"architectures": 5}, "'architectures' must be a list of class names"),
    ("ssm_cfg-list", "ssm", {"ssm_cfg": [1], "model_type": "mamba2"}, "'ssm_cfg' must be a table"),
    ("huge-int", "tf", ('"hidden_size": 32', f'"hidden_size": {HUGE}'),
     "'hidden_size' is an integer of 5000 digits, too long to read"),
    ("huge-int-nested", "ssm", ('"d_state": 8', f'"d_state": {HUGE}'), "'ssm_cfg.d_state' is an integer of 5000"),
    ("expand-fraction", "tf", {"expand": 2.5}, "'expand' must be an integer (a JSON number such as 2, or 2.0), got 2.5"),
    ("ssm-expand-fraction", "ssm", {"ssm_cfg": {"layer": "Mamba2", "expand": 2.5}}, "'ssm_cfg.expand' must be an "
                                                                                    "integer"),
    ("n_groups-string", "tf", {"n_groups": "2"}, "'n_groups' must be an integer (a JSON number such as 2, or 2.0), "
                                                 "got '2'"),
    ("num_heads-fraction", "tf", {"num_heads": 8.5}, "'num_heads' must be an integer"),
    ("no-num_hidden_layers", "tf", {"num_hidden_layers": None}, "'num_hidden_layers' is missing; the transformers "
                                                                "Mamba-2 layout (model_type mamba2"),
]


def _edit_config(src, dst, edit) -> None:
    import shutil
    shutil.copytree(src, dst)
    text = (dst / "config.json").read_text()
    if isinstance(edit, tuple):
        text = json.dumps(json.loads(text))
        assert edit[0] in text
        text = text.replace(*edit)
    else:
        cfg = json.loads(text)
        cfg.update(edit)
        cfg = {k: v for k, v in cfg.items() if v is not None}
        text = json.dumps(cfg)
    (dst / "config.json").write_text(text)


@pytest.mark.parametrize("case,layout,edit,fragment", BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
def test_a_bad_mamba2_config_value_is_exit_2_naming_the_key(m2_dirs, tmp_path, capsys, case, layout, edit, fragment):
    """Each was a traceback (OverflowError, TypeError, AttributeError, ValueError), a silent truncation
    (expand 2.5 ran as 2) or a bare key name; now exit 2, naming the key and what is valid, no file."""
    from harness.cli import capture_main
    from helpers import run_cli

    model = tmp_path / "m"
    _edit_config(m2_dirs / layout, model, edit)
    out = tmp_path / "o"
    out.mkdir()
    rc = run_cli(capture_main, ["--model", model, "--modes", "fp32", "--no_cache", "--output_file", out / "x.npz"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert fragment in err and "Traceback" not in err
    assert list(out.iterdir()) == []


def test_an_integral_float_size_is_read_as_the_integer(m2_dirs, tmp_path):
    """docs/models.md: num_heads 8.0 is the integer 8 (JSON has one number type); the same model as 8."""
    _edit_config(m2_dirs / "tf", tmp_path / "m", {"num_heads": 8.0, "n_groups": 2.0})
    assert open_checkpoint(tmp_path / "m").dims == open_checkpoint(m2_dirs / "tf").dims


def test_an_infinite_size_is_exit_2_in_points_export_and_the_shell_wrapper(m2_dirs, tmp_path, capsys):
    """"n_groups": Infinity was an OverflowError traceback in every command that opens a model directory."""
    import os
    import subprocess
    import sys

    from conftest import ROOT
    from harness.cli import main

    model = tmp_path / "m"
    _edit_config(m2_dirs / "tf", model, {"n_groups": float("inf")})
    fragment = "'n_groups' must be an integer (a JSON number such as 2, or 2.0), got inf"
    assert main(["points", "--model", str(model)]) == 2
    assert fragment in capsys.readouterr().err
    assert main(["export", "--model", str(model), "--output_dir", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err and not (tmp_path / "q").exists()
    env = {**os.environ, "QUAMBA_HARNESS_CACHE": str(tmp_path / "cache"), "PYTHON": sys.executable,
           "MODEL": str(model), "OUTPUT_FILE": str(tmp_path / "w.npz")}
    r = subprocess.run(["bash", str(ROOT / "capture_first_layer.sh"), "fp32"], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=600)
    assert r.returncode == 2 and fragment in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "w.npz").exists()


@pytest.mark.parametrize("shape,problem", [
    ({"ngroups": 4, "headdim": 8}, "this model has 2 heads per SSD group and headdim 8"),
    ({"ngroups": 1, "headdim": 2}, "this model has 32 heads per SSD group and headdim 2"),
], ids=["2-heads-per-group", "headdim-2"])
def test_a_shape_quamba2_cannot_group_is_refused_before_any_work(tmp_path, capsys, shape, problem):
    """A Mamba-2 whose SSD input Quamba2 cannot split into 4 head x 4 dim groups: capture ran fp32, failed in
    calibration and wrote a pair (exit 1), while export refused it up front; now both refuse it before any work,
    exit 2 naming the mode and the problem. W4A16 quantizes no activation: it is not refused."""
    from harness.cli import capture_main, main
    from harness.recipes.registry import recipe_for
    from helpers import run_cli

    import shutil

    from conftest import TOKENIZER

    model = tmp_path / "m"
    make_mamba2(model, layers=1, seed=4, vocab=4096, **shape)
    shutil.copy(TOKENIZER, model / "tokenizer.json")  # a model the run would otherwise go through
    out = tmp_path / "o"
    out.mkdir()
    for mode in ("q2-w8a8", "q2-w4a8"):
        rc = run_cli(capture_main, ["--model", model, "--modes", "fp32", mode, "--no_cache",
                                    "--output_file", out / "x.npz", "--seq_len", 16, "--calib_data_num", 4,
                                    "--calib_seqlen", 16, "--calib_batch_size", 2])
        err = capsys.readouterr().err
        assert rc == 2 and f"mode {mode} cannot run on {model}: Quamba2 groups each SSD group's heads" in err
        assert problem in err and "Traceback" not in err and "calibrat" not in err
        assert list(out.iterdir()) == []
    assert run_cli(main, ["export", "--model", model, "--output_dir", tmp_path / "q"]) == 2
    assert problem in capsys.readouterr().err and not (tmp_path / "q").exists()
    dims = open_checkpoint(model).dims
    assert recipe_for(get_mode("q2-w4a16")).model_problem(get_mode("q2-w4a16"), dims) is None
    assert recipe_for(get_mode("fp32")).model_problem(get_mode("fp32"), dims) is None
