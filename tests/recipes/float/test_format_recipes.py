"""Number formats as recipe knobs: weight_format, act_format, state_format and the per-layer table, on the
shipped tiny model (the captured taps equal fake_quantize of the fp32 mode's, the stats record each layer)."""
import json
from pathlib import Path

import pytest
import torch

from harness.architectures.mamba1.build import layer_formats
from harness.kernels.quant import to_output
from harness.formats import fake_quantize
from harness.modes import ModeError, load_modes_file
from harness.recipes.registry import get_mode
from harness.spec import FloatOut, FormatOut, ModelDims
from harness.store.reader import load_capture
from helpers import run_modes

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "models" / "mamba-tiny"
MODES = {"modes": {
    "hif": {"base": "fp32", "act_format": "hifp8"},
    "w4": {"base": "fp32", "weight_format": "int4_g128", "state_format": "bf16"},
    "mixed": {"base": "fp32", "layers": {"0": {"act_format": "nvfp4"}, "1-": {"act_format": "bf16"}}},
}}


def _modes_file(tmp_path, modes=MODES) -> Path:
    f = tmp_path / "m.json"
    f.write_text(json.dumps(modes))
    return f


def test_format_knobs_parse_and_record_only_when_set(tmp_path):
    recipes = {r.name: r for r in load_modes_file(_modes_file(tmp_path))}
    assert recipes["hif"].knobs()["act_format"] == "hifp8" and "weight_format" not in recipes["hif"].knobs()
    assert "act_format" not in get_mode("0").knobs() and not get_mode("0").has_formats
    mixed = recipes["mixed"]
    assert mixed.knobs()["layers"] == {"0": {"act_format": "nvfp4"}, "1-": {"act_format": "bf16"}}
    assert [mixed.for_layer(i).act_format for i in range(4)] == ["nvfp4", "bf16", "bf16", "bf16"]


@pytest.mark.parametrize("spec,message", [
    ({"base": "fp32", "act_format": "fp7"}, "knob act_format='fp7' is not valid; valid values: none, bf16"),
    ({"base": "0", "act_format": "hifp8"}, "need a floating-point recipe"),
    ({"base": "fp32", "layers": {"3-1": {"act_format": "bf16"}}}, "layer range '3-1' is not valid"),
    ({"base": "fp32", "layers": {"0": {"rotate": "no"}}}, "per-layer knobs: weight_format, act_format"),
    ({"base": "fp32", "layers": ["0"]}, "layers must map layer ranges"),
])
def test_bad_format_knobs_are_mode_errors(tmp_path, spec, message):
    with pytest.raises(ModeError, match=message):
        load_modes_file(_modes_file(tmp_path, {"modes": {"bad": spec}}))


def test_format_out_is_fake_quantize():
    v = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    assert torch.equal(to_output(v, FormatOut("mxfp4_e2m1")), fake_quantize(v, "mxfp4_e2m1"))
    assert torch.equal(to_output(v, FloatOut(torch.float16)), v.half().float())


def test_layer_formats_names_what_a_block_could_not_take():
    dims = ModelDims(d_model=64, d_inner=128, d_state=16, d_conv=4, dt_rank=4, n_layer=3, vocab_size=10, norm_eps=1e-5)
    recipe = load_modes_file_from({"base": "fp32", "act_format": "mxfp8_e4m3", "weight_format": "int4_g128"})
    rows = layer_formats(recipe, dims, 1)
    assert set(rows) == {"0", "1"}
    assert rows["0"]["act_format"] == "mxfp8_e4m3" and rows["0"]["state_format"] == "none"
    # x_proj.out is 4 + 32 = 36 wide (not a multiple of 32); in_proj's and dt_proj's in-features 64, 4 (not of 128)
    assert rows["0"]["kept"] == ["x_proj.out", "in_proj.weight", "dt_proj.weight"]


def load_modes_file_from(spec: dict):
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        return load_modes_file(_modes_file(Path(d), {"modes": {"m": spec}}))[0]


@pytest.fixture(scope="module")
def format_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("fmt")
    run_modes(TINY, d, ["fp32", "0", "hif", "w4", "mixed"], taps=["norm.out", "in_proj.out", "ssm.state"],
              layers=["all"], seq_len=32, modes_file=_modes_file(d))
    return load_capture(d / "capture.npz")


def test_act_format_puts_every_activation_point_on_its_grid(format_run):
    cf = format_run
    fp32 = torch.from_numpy(cf.array("fp32", "L0.norm.out"))
    assert torch.equal(torch.from_numpy(cf.array("hif", "L0.norm.out")), fake_quantize(fp32, "hifp8"))
    xz = torch.from_numpy(cf.array("hif", "L1.in_proj.out"))
    ref = torch.from_numpy(cf.array("fp32", "L1.in_proj.out"))
    assert torch.equal(fake_quantize(xz, "hifp8"), xz) and not torch.equal(fake_quantize(ref, "hifp8"), ref)


def test_weight_and_state_formats(format_run):
    cf = format_run
    state = torch.from_numpy(cf.array("w4", "L0.ssm.state"))
    assert torch.equal(state.bfloat16().float(), state)          # stored in bf16 after every step
    assert not torch.equal(torch.from_numpy(cf.array("fp32", "L0.ssm.state")).bfloat16().float(),
                           torch.from_numpy(cf.array("fp32", "L0.ssm.state")))
    # the tiny model's in_proj (in-features d_model) and dt_proj (dt_rank) do not fit groups of 128: they keep
    # fp32 weights and the stats say so; norm.out (before any weight) is fp32's, the block output is not
    assert cf.manifest["modes"]["w4"]["layer_formats"]["0"]["kept"] == ["in_proj.weight", "dt_proj.weight"]
    assert torch.equal(torch.from_numpy(cf.array("w4", "L0.in_proj.out")), torch.from_numpy(cf.array("fp32", "L0.in_proj.out")))
    assert not torch.equal(torch.from_numpy(cf.array("w4", "output")), torch.from_numpy(cf.array("fp32", "output")))


def test_per_layer_assignment_runs_and_is_recorded(format_run):
    cf = format_run
    fp32 = torch.from_numpy(cf.array("fp32", "L0.norm.out"))
    assert torch.equal(torch.from_numpy(cf.array("mixed", "L0.norm.out")), fake_quantize(fp32, "nvfp4"))
    l1 = torch.from_numpy(cf.array("mixed", "L1.norm.out"))
    assert torch.equal(l1.bfloat16().float(), l1)
    rows = cf.manifest["modes"]["mixed"]["layer_formats"]
    assert [rows[str(i)]["act_format"] for i in range(len(rows))] == ["nvfp4"] + ["bf16"] * (len(rows) - 1)
    assert cf.manifest["modes"]["mixed"]["recipe"]["layers"]["1-"] == {"act_format": "bf16"}
    assert "layer_formats" not in cf.manifest["modes"]["0"] and "act_format" not in cf.manifest["modes"]["0"]["recipe"]


def test_a_recorded_format_recipe_is_read_back_for_resume(tmp_path):
    from harness.runner.resume import recorded_recipe

    for recipe in load_modes_file(_modes_file(tmp_path)):
        entry = json.loads(json.dumps({"title": recipe.title, "recipe": recipe.knobs()}))  # as the stats hold it
        assert recorded_recipe(recipe.name, entry) == recipe
