import json

import pytest

from harness.modes import BUILTIN_MODES, KNOBS, PRESETS, ModeError, ModeRecipe, load_modes_file
from harness.recipes.registry import get_mode, resolve_modes


def test_builtin_table_matches_modes_md():
    # spot checks of docs/spec/modes.md "The built-in modes"
    assert get_mode("0").knobs() == dict(zip(KNOBS, "int8 yes int8 int8 static int8 int8 kernel int8 fp16 quamba".split()))
    # docs/spec/modes.md `prep`: built-in quantized modes quamba, fp32 (and mode 1, unchanged) exact
    assert {m: r.prep for m, r in BUILTIN_MODES.items()} == {
        "fp32": "exact", "1": "exact", **{m: "quamba" for m in ("0", "2-0", "2-1", "2-2", "2-3", "2-4", "3")},
        "q2-w8a8": "quamba2", "q2-w4a8": "quamba2", "q2-w4a16": "quamba2"}
    assert get_mode("3").in_proj_out == "fp" and get_mode("3").conv_in == "dynamic"
    assert get_mode("2-3").ssm_u == "requant" and get_mode("2-4").ssm_u == "fp32"
    assert get_mode("1").rotate == "no" and get_mode("1").weights == "fp16"
    assert not get_mode("fp32").needs_calibration and get_mode("2-0").needs_calibration
    assert list(BUILTIN_MODES) == ["fp32", "1", "0", "2-0", "2-1", "2-2", "2-3", "2-4", "3", "q2-w8a8", "q2-w4a8", "q2-w4a16"]


def test_presets():
    assert PRESETS["all"] == ("fp32", "0", "2-0", "2-1", "2-2", "2-3", "2-4", "3")
    assert [r.name for r in resolve_modes(["essential"])] == ["fp32", "0", "2-1", "2-2", "2-4"]
    assert [r.name for r in resolve_modes(["quant_only", "fp32", "0"])] == list(PRESETS["quant_only"]) + ["fp32"]
    assert "1" not in [n for p in PRESETS.values() for n in p]


def test_unknown_mode_lists_valid_ones():
    with pytest.raises(ModeError, match=r"unknown mode '2-9'; valid: fp32, 1, 0, 2-0, 2-1, 2-2, 2-3, 2-4, 3, q2-w8a8"):
        resolve_modes(["fp32", "2-9"])


def test_unknown_knob_value_lists_valid_values():
    with pytest.raises(ModeError, match=r"knob ssm_u='float' is not valid; valid values: int8, grid, requant, fp32"):
        ModeRecipe("x", "t", **{**get_mode("0").knobs(), "ssm_u": "float"})


@pytest.mark.parametrize("change,message", [
    ({"rotate": "no"}, "need rotate=yes"),
    ({"conv_out": "fp32"}, "ssm_u=int8 needs conv_out=int8"),
    ({"ssm_u": "requant"}, "ssm_u=requant needs conv_out=fp32"),
    ({"weights": "fp32", "prep": "quamba"}, "prep=quamba needs weights=fp16 or int8"),
])
def test_inconsistent_recipes_are_rejected(change, message):
    with pytest.raises(ModeError, match=message):
        ModeRecipe("x", "t", **{**get_mode("0").knobs(), **change})


def test_modes_file_json_and_toml(tmp_path):
    j = tmp_path / "m.json"
    j.write_text(json.dumps({"modes": {"2-4dyn": {"base": "2-4", "conv_in": "dynamic", "title": "t"}}}))
    t = tmp_path / "m.toml"
    t.write_text('[modes.w8-only]\nbase = "fp32"\nweights = "int8"\n')
    (r,) = load_modes_file(j)
    assert r.name == "2-4dyn" and r.conv_in == "dynamic" and r.ssm_u == "fp32" and r.title == "t"
    (w,) = load_modes_file(t)
    assert w.weights == "int8" and w.norm_out == "fp" and w.needs_calibration
    assert [m.name for m in resolve_modes(["0", "2-4dyn"], j)] == ["0", "2-4dyn"]


@pytest.mark.parametrize("content,message", [
    ('{"modes": {"m": {"base": "0", "conv_iin": "dynamic"}}}', r"unknown key\(s\) 'conv_iin'; valid keys: base, title, weights"),
    ('{"modes": {"m": {"base": "9"}}}', "unknown base '9'"),
    ('{"modes": {"m": {"weights": "int8"}}}', "lacks knob"),
    ('{"modes": {"m": {"base": "0", "ssm_u": "grid", "conv_out": "fp32"}}}', "needs conv_out=int8"),
    ('{"modes": {"bad_name": {"base": "0"}}}', "invalid mode name"),
    ('{"modes": {"0": {"base": "2-4"}}}', "already defined"),
    ('{"mode": {}}', "one table 'modes'"),
    ('{"modes": ', "not valid JSON"),
])
def test_modes_file_errors(tmp_path, content, message):
    f = tmp_path / "m.json"
    f.write_text(content)
    with pytest.raises(ModeError, match=message):
        resolve_modes(["0"], f)


def test_prep_of_user_modes(tmp_path):
    f = tmp_path / "m.json"
    full = {k: v for k, v in get_mode("2-4").knobs().items() if k != "prep"}
    f.write_text(json.dumps({"modes": {"ex": {"base": "0", "prep": "exact"}, "q": full,
                                       "w16": {**full, "weights": "fp16", "norm_out": "fp", "in_proj_out": "fp",
                                               "conv_out": "fp32", "had_out": "fp", "ssm_u": "fp32"}}}))
    ex, q, w16 = load_modes_file(f)
    assert ex.prep == "exact" and ex.knobs() == {**get_mode("0").knobs(), "prep": "exact"}
    assert q.prep == "quamba" and w16.prep == "exact"  # without a base: quamba for int8 weights, else exact
    f.write_text(json.dumps({"modes": {"bad": {"base": "0", "prep": "fp16"}}}))
    with pytest.raises(ModeError, match="prep='fp16' is not valid; valid values: quamba, exact, quamba2"):
        load_modes_file(f)
