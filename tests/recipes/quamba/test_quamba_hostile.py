"""Hostile Quamba checkpoints are refused before any work (issue 21 items 12, 13, 15): a scale that is NaN,
inf, 0 or negative, a float weight holding NaN, a norm epsilon out of range, an n_layer the state dict does
not hold, a config field of the wrong type. Each is exit 2 naming the key or field and what is valid, and no
file is written. A NaN that still arises inside a mode fails that mode instead of becoming int8 code 0."""
import math
import tracemalloc

import pytest
import torch

from helpers import run_modes
from quamba_fixture import handmade_config, handmade_state_dict, write_handmade

from harness.checkpoints.loading import ModelDirError
from harness.recipes.quamba.checkpoint import open_quamba
from harness.cli import capture_main
from harness.kernels.quant import quantize
from harness.spec import Rounding

FAST = ["--seq_len", "16", "--calib_data_num", "4", "--calib_seqlen", "16"]
SCALE = "a scale must be a finite number > 0"
L0 = "backbone.layers.0."


def _scale(key, value):
    def apply(sd, cfg):
        old = sd[key]
        sd[key] = value if type(old) is float else torch.full_like(old, value)
    return apply


def _nan_weight(key):
    def apply(sd, cfg):
        sd[key] = sd[key].clone()
        sd[key][3] = math.nan
    return apply


def _cfg(**changes):
    def apply(sd, cfg):
        for key, value in changes.items():
            table, _, name = key.rpartition("__")
            (cfg.setdefault(table, {}) if table else cfg)[name] = value
    return apply


def _capture_exit(tmp_path, capsys, change) -> tuple[int, str]:
    sd, cfg = handmade_state_dict(), handmade_config()
    change(sd, cfg)
    q = write_handmade(tmp_path / "bad", sd=sd, config=cfg)
    code = capture_main(["--model", str(q), "--modes", "0", "--output_file", str(tmp_path / "out.npz"),
                         "--no_cache", *FAST])
    assert not list(tmp_path.glob("out*")), "a refused checkpoint leaves no file"
    return code, capsys.readouterr().err


@pytest.mark.parametrize("change, message", [
    (_scale(L0 + "norm.output_scale", math.nan), f"'{L0}norm.output_scale' is nan; {SCALE}"),
    (_scale(L0 + "norm.output_scale", 0.0), f"'{L0}norm.output_scale' is 0.0; {SCALE}"),
    (_scale(L0 + "mixer.in_proj.b", math.inf), f"'{L0}mixer.in_proj.b' is inf; {SCALE}"),
    (_scale(L0 + "mixer.selective_scan.D_scale", -0.5), f"'{L0}mixer.selective_scan.D_scale' is -0.5; {SCALE}"),
    (_scale("backbone.layers.1.mixer.conv1d.output_scale", -0.02),
     f"'backbone.layers.1.mixer.conv1d.output_scale' is -0.02; {SCALE}"),
    (_nan_weight(L0 + "norm.weight"),
     f"'{L0}norm.weight' holds 1 NaN or Inf values (the first at flat index 3); weights must be finite"),
    (_nan_weight("backbone.embedding.weight"), "'backbone.embedding.weight' holds"),
    (_cfg(norm_epsilon=-1.0), "the norm epsilon must be a finite number in (0, 1), got -1.0"),
    (_cfg(norm_epsilon=1e30), "the norm epsilon must be a finite number in (0, 1), got 1e+30"),
    (_cfg(n_layer=50_000), "config.json declares n_layer = 50000 but the state dict holds 2 blocks"),
    (_cfg(d_model=10 ** 9), "sizes must be positive integers up to 2^20, got d_model=1000000000"),
    (_cfg(ssm_cfg=[1]), "field 'ssm_cfg' must be a table (a JSON object), got [1]"),
    (_cfg(norm_cfg="x"), "field 'norm_cfg' must be a table (a JSON object), got 'x'"),
    (_cfg(pad_vocab_size_multiple=0), "field 'pad_vocab_size_multiple' must be an integer from 1 to 2^20, got 0"),
    (_cfg(ssm_cfg__d_state="16"), "field 'ssm_cfg.d_state' must be an integer (a JSON integer), got '16'"),
    (_cfg(ssm_cfg__layer={}), "field 'ssm_cfg.layer' must be a string (a JSON string), got {}"),
    (_cfg(embedding_cfg__layer=7), "field 'embedding_cfg.layer' must be a string"),
    (_cfg(n_layer=2.0), "field 'n_layer' must be an integer (a JSON integer), got 2.0"),
    (_cfg(norm_epsilon=True), "field 'norm_epsilon' must be a number"),
    (_cfg(ssm_cfg__expand=1e308), "sizes must be positive integers up to 2^20"),
], ids=["nan_norm_scale", "zero_norm_scale", "inf_in_proj_b", "negative_D_scale", "negative_conv_out",
        "nan_norm_weight", "nan_embedding", "eps_negative", "eps_huge", "n_layer_million", "d_model_huge",
        "ssm_cfg_list", "norm_cfg_str", "pad_zero", "d_state_str", "layer_table", "embedding_layer_int",
        "n_layer_float", "eps_bool", "expand_huge"])
def test_a_hostile_checkpoint_is_exit_2_naming_the_key(tmp_path, capsys, change, message):
    """Before the fix these ran mode 0 to "ok" with an all-zero output (NaN and 0 scales), a plausible but
    wrong output (negative scales, eps), built a key table for a million blocks, or ended in a traceback."""
    code, err = _capture_exit(tmp_path, capsys, change)
    assert code == 2 and message in err, err
    assert "Traceback" not in err


def test_a_million_declared_blocks_are_refused_before_a_table_is_built(tmp_path):
    """n_layer = 10**6 used to build 40 million expected keys (memory growing for minutes, 11.7 GB after 11
    minutes): now the count of blocks present is checked first, and the refusal allocates next to nothing.
    50,000 blocks (a bounded failure without the fix: about a GB) show it."""
    cfg = handmade_config()
    cfg["n_layer"] = 50_000
    q = write_handmade(tmp_path / "q", config=cfg)
    tracemalloc.start()
    try:
        with pytest.raises(ModelDirError, match="declares n_layer = 50000") as e:
            open_quamba(q)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 << 20, peak
    assert str(e.value).startswith(f"{q / 'pytorch_model.bin'}: config.json declares")  # names the file


def test_a_nan_inside_a_mode_fails_the_mode(tmp_path, monkeypatch):
    """A NaN reaching an int8 quantization has no code: the cast made it 0 and the mode ran to "ok" with an
    all-zero output. With the checkpoint check bypassed, a NaN norm scale must fail mode 0 (exit 1 path)."""
    sd = handmade_state_dict()
    sd[L0 + "norm.output_scale"] = math.nan
    q = write_handmade(tmp_path / "q", sd=sd)
    monkeypatch.setattr("harness.recipes.quamba.checkpoint.check_values", lambda *a: None)
    out = run_modes(q, tmp_path, ["0"], seq_len=16)
    entry = out.stats["modes"]["0"]
    assert entry["status"] == "error" and "NaN has no int8 code" in entry["error"], entry


def test_quantize_refuses_nan_and_saturates_inf():
    with pytest.raises(FloatingPointError, match="1 NaN of 3 values"):
        quantize(torch.tensor([1.0, math.nan, -2.0]), 0.1, Rounding.HALF_EVEN)
    q = quantize(torch.tensor([1.0, math.inf, -math.inf]), 0.1, Rounding.HALF_EVEN)
    assert q.codes.tolist() == [10, 127, -128] and q.n_clipped == 2


def test_null_fields_take_quambas_defaults_and_a_null_size_is_named(tmp_path):
    """json.dump(config.__dict__) may write null for an unset field: it reads as the default (Quamba's own
    constructors take None as unset); a required size that is null is named with its type."""
    cfg = handmade_config()
    cfg.update(d_intermediate=None, attn_layer_idx=None, norm_cfg=None, pad_vocab_size_multiple=None)
    cfg["ssm_cfg"]["d_conv"] = None
    assert open_quamba(write_handmade(tmp_path / "q", config=cfg)).dims.d_conv == 4
    cfg["n_layer"] = None
    with pytest.raises(ModelDirError, match=r"field 'n_layer' must be an integer \(a JSON integer\), got None"):
        open_quamba(write_handmade(tmp_path / "n", config=cfg))


def test_a_float_mamba_ssm_config_with_a_list_for_a_table_is_exit_2(tmp_path, capsys):
    """The float reader likewise: ssm_cfg: [1] in a mamba_ssm config ended in an AttributeError traceback."""
    import json
    import shutil

    from conftest import SHIPPED
    model = tmp_path / "m"
    shutil.copytree(SHIPPED, model)
    (model / "config.json").write_text(json.dumps({"d_model": 192, "n_layer": 3, "ssm_cfg": [1]}))
    code = capture_main(["--model", str(model), "--modes", "fp32", "--output_file", str(tmp_path / "o.npz"),
                         "--no_cache", *FAST])
    err = capsys.readouterr().err
    assert code == 2 and "config.json: 'ssm_cfg' must be a table" in err, err
