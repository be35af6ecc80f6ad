"""Quamba2 W4A8 / W4A16 checkpoints exported with --quantize_embedding --quantize_lm_head (Quamba's eval.sh does for
every W4 recipe): the W4O16Embedding and the recipe's W4 lm_head, hand-packed from Quamba's source
(tests/fixtures/w4head_fixture.py), are read and run as the kernels compute them, on Mamba-2 and Mamba-1; a malformed key
is exit 2 naming it."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from conftest import TOKENIZER
from harness.recipes.quamba.formats import open_any_quamba
from harness.cli import capture_main
from harness.emulation.modules import EmuRMSNorm
from harness.kernels.int4 import Int4Weight
from harness.kernels.w4_linear import w4a8_linear, w4a16_linear
from harness.kernels.embedding_head import quantize_rows_int4_fp16, quantized_rows
from harness.recipes.registry import get_mode, on_architecture
from harness.runner.head import build_head
from harness.runner.pairing import open_models
from harness.spec import FloatOut, QuantOut, Rounding
from helpers import run_cli
from marlin_fixture import w4_config, w4_state_dict
from quamba1_w4_fixture import w4_mamba1_config, w4_mamba1_state_dict
from w4head_fixture import HEADS, VOCAB, add_w4_head

RECIPES = ("W4A8", "W4A16")


def _write(path, arch: str, recipe: str, edit=None, embedding: bool = True, head: bool = True):
    if arch == "mamba2":
        sd, _ = w4_state_dict([[recipe], [recipe]], vocab=VOCAB, size=0.01)
        cfg = w4_config([[recipe], [recipe]], vocab=VOCAB)
    else:
        sd, _ = w4_mamba1_state_dict(recipe)
        cfg = w4_mamba1_config(recipe)
    truth = add_w4_head(sd, cfg, recipe, head=head) if embedding else {}
    if edit is not None:
        edit(sd, cfg)
    path.mkdir(parents=True, exist_ok=True)
    torch.save(sd, path / "pytorch_model.bin")
    (path / "config.json").write_text(json.dumps(cfg))
    shutil.copy(TOKENIZER, path / "tokenizer.json")
    return path, sd, truth


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("w4head")
    return {(a, r): _write(root / f"quamba-{a}-{r.lower()}", a, r) for a in ("mamba2", "mamba1") for r in RECIPES}


def _mode(arch: str, recipe: str):
    mode = get_mode(f"q2-{recipe.lower()}")
    return on_architecture(mode, "mamba1") if arch == "mamba1" else mode


@pytest.mark.parametrize("arch", ["mamba2", "mamba1"])
def test_the_embedding_rows_are_the_int4_rows_the_harness_computes_from_the_fp16_table(arch, ckpts):
    """W4O16Embedding.from_fp16 as Quamba writes it (the fixture) unpacked and looked up as the kernel does is the
    harness's embedding=int4 emulation of the same fp16 table (kernels.embedding_head): codes, scales and rows."""
    path, sd, truth = ckpts[(arch, "W4A16")]
    ckpt = open_any_quamba(path) if arch == "mamba2" else open_models(path, None).quamba
    rows = ckpt.embedding()
    codes, scales = quantize_rows_int4_fp16(truth["table"])
    assert rows.dtype == torch.float16 and rows.shape == truth["table"].shape
    assert torch.equal(sd["backbone.embedding.scales"], scales.to(torch.float16))
    assert torch.equal(rows.float(), quantized_rows(truth["table"].float(), "int4"))
    # the rows hold every code: (row / scale) + 8 recovers the harness's codes exactly
    back = torch.round(rows.float() / scales.float()[:, None]) + 8
    assert torch.equal(back, codes.float())
    ids = torch.tensor([[0, 5, VOCAB - 1 if arch == "mamba2" else 4095]])
    bank = open_models(path, None).bank
    looked_up = bank.embed(ids, True, torch.float16, _mode(arch, "W4A16").prep, "int4")
    assert torch.equal(looked_up, rows[ids].float())


def test_the_stored_rows_run_as_embedding_int4_of_the_fp16_table(tmp_path):
    """End to end (Mamba-2; the embedding knob is prep=quamba2's): the mode run from a W4O16Embedding checkpoint
    computes, bit for bit, what the mode with embedding=int4 computes from the same checkpoint holding the fp16
    table (every tap and the logits)."""
    arch = "mamba2"
    fp16, _, _ = _write(tmp_path / "fp16", arch, "W4A16", embedding=False)
    w4, _, _ = _write(tmp_path / "w4", arch, "W4A16", head=False)
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"modes": {"q2-e": {"base": "q2-w4a16", "embedding": "int4"}}}))
    common = ["--layers", "all", "--end-to-end", "--seq_len", 10, "--taps", "all", "--quiet",
              "--calib_file", tmp_path / "absent.txt"]
    assert run_cli(capture_main, ["--model", fp16, "--modes", "q2-e", "--modes_file", f, *common,
                                  "--output_file", tmp_path / "a.npz"]) == 0
    assert run_cli(capture_main, ["--model", w4, "--modes", "q2-w4a16", *common,
                                  "--output_file", tmp_path / "b.npz"]) == 0
    ours, theirs = np.load(tmp_path / "a.npz"), np.load(tmp_path / "b.npz")
    keys = [k for k in ours.files if k.startswith("mode_q2-e__")]
    assert len(keys) > 10 and "mode_q2-e__logits" in keys
    for k in keys:
        assert np.array_equal(ours[k], theirs[k.replace("mode_q2-e__", "mode_q2-w4a16__")]), k


@pytest.mark.parametrize("arch", ["mamba2", "mamba1"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_the_head_is_the_marlin_gemm_of_the_packed_codes(arch, recipe, ckpts):
    path, sd, truth = ckpts[(arch, recipe)]
    models = open_models(path, None)
    head = build_head(_mode(arch, recipe), models.bank)
    residual = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(4))
    logits = head(residual)
    vocab = truth["codes"].shape[0]
    assert logits.shape == (2, 3, vocab)  # the Marlin out-features padding is dropped
    w = Int4Weight(truth["codes"], truth["groups"], truth["channel"])
    eps = models.bank.dims.norm_eps
    if recipe == "W4A8":  # QRMSNorm at lm_head:input, then Marlin-QQQ with fp16 output
        x = EmuRMSNorm(None, eps, QuantOut(sd["backbone.norm_f.output_scale"], Rounding.HALF_EVEN))(residual)
        expected = w4a8_linear(x, w, False)
    else:  # the fp16 RMSNorm, then Marlin
        expected = w4a16_linear(EmuRMSNorm(None, eps, FloatOut(torch.float16))(residual), w)
    assert torch.equal(logits, expected)
    assert torch.isfinite(logits).all() and logits.abs().max() > 0


@pytest.mark.parametrize("arch", ["mamba2", "mamba1"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_the_mode_runs_from_the_checkpoint_and_says_which_head_it_held(arch, recipe, ckpts, tmp_path):
    path = ckpts[(arch, recipe)][0]
    out = tmp_path / "q.npz"
    rc = run_cli(capture_main, ["--model", path, "--modes", f"q2-{recipe.lower()}", "--output_file", out,
                                "--seq_len", 8, "--quiet", "--calib_file", tmp_path / "absent.txt"])
    assert rc == 0
    stats = json.loads(out.with_name("q_stats.json").read_text())
    assert stats["modes"][f"q2-{recipe.lower()}"]["status"] == "ok"
    quamba = stats["provenance"]["model"]["quamba"]
    assert quamba["embedding"] == "W4O16Embedding" and quamba["lm_head"] == HEADS[recipe]


def _drop(key):
    return lambda sd, cfg: sd.pop(key)


def _set(key, value):
    return lambda sd, cfg: sd.__setitem__(key, value(sd[key]))


def _nan_first(t):
    t = t.clone()
    t.view(-1)[0] = float("nan")
    return t


BAD = [
    ("W4A8", _drop("backbone.embedding.scales"), "'backbone.embedding.scales' is missing"),
    ("W4A8", _set("backbone.embedding.weight", lambda t: t.to(torch.int64)), "'backbone.embedding.weight' is a int64"),
    ("W4A16", _set("backbone.embedding.scales", _nan_first), "'backbone.embedding.scales' holds 1 NaN"),
    ("W4A8", _drop("backbone.norm_f.output_scale"), "'backbone.norm_f.output_scale' is missing"),
    ("W4A8", _set("lm_head.s_channel", lambda t: t.to(torch.float16)), "'lm_head.s_channel' is a float16"),
    ("W4A8", _set("lm_head.input_scale", lambda t: t * 2), "'lm_head.input_scale' = 0.0599999986"),
    ("W4A8", _set("lm_head.input_scale", lambda t: -t), "'lm_head.input_scale' is -0.0299999993"),
    ("W4A8", _set("lm_head.s_group", lambda t: -t), "'lm_head.s_group' holds"),
    ("W4A16", _set("lm_head.weight", lambda t: t[:, :VOCAB * 2].contiguous()), "'lm_head.weight' is a int32 tensor of "
     f"shape [16, {VOCAB * 2}], expected a int32 tensor of shape [16, {4352 * 2}]"),
    ("W4A16", _set("lm_head.scale", _nan_first), "'lm_head.scale' holds"),
    ("W4A16", _drop("lm_head.workspace"), "'lm_head.workspace' is missing"),
    ("W4A16", lambda sd, cfg: cfg.__setitem__("lm_head_cfg", {"layer": "W4A8B16O16Linear"}),
     "lm_head_cfg.layer 'W4A8B16O16Linear' with W4A16 (valid: Linear, W4A16B16O16Linear) is not supported"),
    ("W4A8", lambda sd, cfg: cfg.__setitem__("embedding_cfg", {"layer": "W8O16Embedding"}),
     "embedding_cfg.layer 'W8O16Embedding' with W4A8 (valid: Embedding, W4O16Embedding) is not supported"),
]


@pytest.mark.parametrize("arch", ["mamba2", "mamba1"])
@pytest.mark.parametrize("recipe, edit, message", BAD, ids=range(len(BAD)))
def test_a_malformed_w4_head_is_exit_2_naming_the_key(arch, recipe, edit, message, tmp_path, capsys):
    if arch == "mamba1" and "lm_head.weight" in message:
        edit = _set("lm_head.weight", lambda t: t[:, :4000].contiguous())
        message = "'lm_head.weight' is a int32 tensor of shape [16, 4000], expected a int32 tensor of shape [16, 8192]"
    path, _, _ = _write(tmp_path / "bad", arch, recipe, edit)
    out = tmp_path / "b.npz"
    rc = run_cli(capture_main, ["--model", path, "--modes", f"q2-{recipe.lower()}", "--output_file", out, "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err, err
    assert not out.exists()


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_head_in_vocabulary_slices_is_the_whole_gemm(recipe, ckpts):
    """kernels.embedding_head.w4_lm_head_logits runs the head `rows` out-features at a time: any slicing (here one
    that does not divide the vocabulary) gives the single GEMM's logits bit for bit."""
    from harness.kernels.embedding_head import w4_lm_head_logits
    from harness.spec import QTensor

    truth = ckpts[("mamba2", recipe)][2]
    w = Int4Weight(truth["codes"], truth["groups"], truth["channel"])
    g = torch.Generator().manual_seed(7)
    if recipe == "W4A8":
        x = QTensor(torch.randint(-128, 128, (2, 3, 256), generator=g, dtype=torch.int8), 0.03)
        whole = w4a8_linear(x, w, False)
    else:
        x = torch.randn(2, 3, 256, generator=g).to(torch.float16).float()
        whole = w4a16_linear(x, w)
    assert torch.equal(w4_lm_head_logits(x, w, rows=1000), whole)
    assert whole.shape == (2, 3, VOCAB)


@pytest.mark.parametrize("d_model, headdim, message", [
    (192, 32, "W4A16B16O16Linear lm_head needs d_model a multiple of 128 above 128"),
    (200, 25, "W4O16Embedding needs d_model a multiple of 32")])
def test_a_width_marlin_or_the_lookup_kernel_cannot_take_is_named(d_model, headdim, message, tmp_path):
    from harness.checkpoints.loading import ModelDirError

    def edit(sd, cfg):
        cfg["d_model"], cfg["ssm_cfg"]["headdim"] = d_model, headdim

    path, _, _ = _write(tmp_path / "w", "mamba2", "W4A16", edit=edit)
    with pytest.raises(ModelDirError, match=message):
        open_any_quamba(path)
