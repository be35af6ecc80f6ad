"""--plugin FILE_OR_MODULE and the entry-point group (harness.plugins, docs/plugins.md).

The plugin under test is the first code block of docs/plugins.md, copied as a user copies it: its mode
w8a16 (int8 per-row weights, fp16 activations) runs through capture beside fp32 and 1, on local workers
bit for bit as in one process, and is listed by `modes`. A plugin that does not import, or registers a
taken name, is exit 2 on every command, naming the file and the name.

The registries are process-global: every test here runs on copies of them (``registries``, autouse), so
nothing a plugin registers in one test is seen by another test, here or in another file.
"""
from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT, make_hf_model, write_hf_dir
from harness import plugins
from harness.architectures import registry as arch_registry
from harness.cli import capture_main, main
from harness.recipes import registry
from harness.store.reader import load_capture
from helpers import FAST_CLI, run_cli

DOC = ROOT / "docs" / "plugins.md"
LINEARS = ("in_proj", "x_proj", "dt_proj", "out_proj")


@pytest.fixture(autouse=True)
def registries(monkeypatch):
    """Copies of every registry and of the plugins' bookkeeping for the test; its plugin modules forgotten after."""
    registry.load_builtins()
    for module, names in ((registry, ("_RECIPES", "_EXTRA_MODES", "_FORMATS", "_EXPORTERS")),
                          (arch_registry, ("_ARCHITECTURES",)), (plugins, ("_LOADED", "_FAILED"))):
        for name in names:
            monkeypatch.setattr(module, name, dict(getattr(module, name)))
    yield
    for name in [n for n in sys.modules if n.startswith((plugins.FILE_MODULE_PREFIX, "plugtest_"))]:
        del sys.modules[name]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_hf_dir(tmp_path_factory.mktemp("plugins") / "m", make_hf_model(d_model=24, n_layer=2, seed=3))


def doc_plugin() -> str:
    """The code block docs/plugins.md opens with (before its first section)."""
    text = DOC.read_text()
    assert text.index("```python") < text.index("\n## "), "docs/plugins.md must open with the plugin"
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


@pytest.fixture
def w8a16(tmp_path) -> Path:
    path = tmp_path / "plugin" / "w8a16.py"
    path.parent.mkdir()
    path.write_text(doc_plugin())
    return path


def capture(out: Path, *argv) -> int:
    out.parent.mkdir(parents=True, exist_ok=True)
    return run_cli(capture_main, [*argv, *FAST_CLI, "--no_cache", "--output_file", out])


def test_the_documented_plugin_runs_its_mode_through_capture(model, w8a16, tmp_path):
    out = tmp_path / "run" / "run.npz"
    assert capture(out, "--model", model, "--plugin", w8a16, "--modes", "fp32", "1", "w8a16") == 0
    stats = json.loads(out.with_name("run_stats.json").read_text())
    assert stats["modes"]["w8a16"]["status"] == "ok" and stats["modes"]["w8a16"]["recipe"]["family"] == "w8a16"
    assert stats["modes"]["w8a16"]["recipe"]["weights"] == "fp16" and stats["provenance"]["plugins"] == [str(w8a16)]
    cmp = stats["comparison"]["modes"]
    mine, fp16 = cmp["w8a16"]["output"], cmp["1"]["output"]
    assert 0 < mine["rel_l2"] < 0.05 and 25 < mine["sqnr_db"] < fp16["sqnr_db"] - 10  # int8 weights: more error
    cf = load_capture(out)
    assert np.array_equal(cf.array("w8a16", "input"), cf.array("1", "input"))  # the same fp16 embedding
    assert not np.array_equal(cf.array("w8a16", "output"), cf.array("1", "output"))


def test_the_plugin_weights_are_int8_per_row_and_the_bank_untouched(model, w8a16):
    from harness.architectures.registry import get_architecture
    from harness.checkpoints.loading import open_checkpoint
    from harness.recipes.registry import get_mode, recipe_for
    from harness.runner.weightbank import WeightBank

    (module,) = plugins.load_plugins([str(w8a16)])
    bank = WeightBank(open_checkpoint(model))
    mode = get_mode("w8a16")
    assert recipe_for(mode).name == "w8a16" and mode.family == "w8a16"
    quantized = recipe_for(mode).build_blocks(mode, bank, None, 1)
    fp16 = get_architecture("mamba1").build_blocks(get_mode("1"), bank, None, 1)  # after: the bank is unchanged
    for q, f in zip(quantized, fp16):
        for name in LINEARS:
            w, w16 = getattr(q, name).weight, getattr(f, name).weight
            scale = w16.abs().amax(dim=1, keepdim=True) / 127
            assert torch.equal(w, torch.round(w16 / scale) * scale) and not torch.equal(w, w16)
            codes = w.double() / scale.double()  # integers up to the fp32 product's rounding, |code| <= 127
            assert (codes - codes.round()).abs().max() < 1e-4 and codes.abs().max() <= 127.0001
            assert torch.allclose(codes.abs().amax(dim=1), torch.full((w.shape[0],), 127.0, dtype=torch.float64))
    ties = module.int8_per_row(torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -3.5]]))  # scale 1: half to even
    assert ties.tolist() == [[127.0, 0.0, 2.0, 2.0, -0.0, -4.0]]


def test_workers_load_the_plugin_and_give_the_serial_arrays(model, w8a16, tmp_path, one_thread):
    from pairs import assert_identical

    argv = ["--model", model, "--plugin", w8a16, "--modes", "fp32", "w8a16", "--samples", "2", "--taps", "all"]
    serial, par = tmp_path / "serial" / "run.npz", tmp_path / "par" / "run.npz"
    assert (capture(serial, *argv), capture(par, *argv, "--workers", "2")) == (0, 0)
    assert_identical(serial, par)
    workers = json.loads(par.with_name("run_stats.json").read_text())["provenance"]["workers"]
    assert workers["units"] == 4 and workers["failed_units"] == []


def test_the_python_api_loads_run_config_plugins(model, w8a16, tmp_path):
    from harness import RunConfig, run

    outcome = run(RunConfig(model=model, plugins=[str(w8a16)], modes=["w8a16"], seq_len=16,
                            output_file=tmp_path / "api.npz"), emit=lambda _s: None)
    assert outcome.failed == [] and outcome.stats["modes"]["w8a16"]["recipe"]["family"] == "w8a16"


def test_modes_lists_the_plugin_mode_and_family(w8a16, capsys):
    assert main(["modes"]) == 0
    assert "w8a16" not in capsys.readouterr().out
    assert main(["modes", "--plugin", str(w8a16), "--plugin", str(w8a16)]) == 0  # twice: loaded once
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("w8a16 "))
    assert row.split()[-3:] == ["w8a16", "mamba1", "mamba2"] and "fp16" in row
    assert "w8a16 (int8 per-channel weights" in out


def test_a_modes_file_may_name_the_plugin_family(model, w8a16, tmp_path):
    modes = tmp_path / "modes.json"
    modes.write_text(json.dumps({"modes": {"w8a16-fp32": {"base": "1", "family": "w8a16", "act_dtype": "fp32"}}}))
    out = tmp_path / "run" / "run.npz"
    assert capture(out, "--model", model, "--plugin", w8a16, "--modes_file", modes, "--modes", "w8a16", "w8a16-fp32") == 0
    stats = json.loads(out.with_name("run_stats.json").read_text())
    assert stats["modes"]["w8a16-fp32"]["recipe"]["family"] == "w8a16"
    cf = load_capture(out)
    assert not np.array_equal(cf.array("w8a16", "output"), cf.array("w8a16-fp32", "output"))


BROKEN = {"syntax": ("x = 1\ndef broken(:\n    pass\n", " has a syntax error: invalid syntax (syntax.py line 2)"),
          "duplicate": ("from harness.modes import BUILTIN_MODES\nfrom harness.recipes.registry import register_mode\n"
                        "register_mode(BUILTIN_MODES['0'])\n", ": mode '0' is already registered"),
          "raises": ("x = 1\nraise RuntimeError('no licence')\n",
                     " failed to import: RuntimeError: no licence (at raises.py line 2)")}


@pytest.mark.parametrize("kind", BROKEN)
def test_a_broken_plugin_is_exit_2_naming_the_file_and_the_problem(kind, model, tmp_path, capsys):
    plugin = tmp_path / f"{kind}.py"
    plugin.write_text(BROKEN[kind][0])
    out = tmp_path / "run" / "run.npz"
    assert capture(out, "--model", model, "--plugin", plugin, "--modes", "fp32") == 2
    err = capsys.readouterr().err
    assert f"error: plugin {plugin}{BROKEN[kind][1]}" in err and "Traceback" not in err
    assert list(out.parent.iterdir()) == []
    assert "w8a16" not in registry.list_modes()


COMMANDS = {"compare": ["compare", "x.npz"], "report": ["report", "x.npz"], "modes": ["modes"], "points": ["points"],
            "export": ["export", "--model", "m", "--output_dir", "o"], "formats": ["formats"],
            "formats --suggest": ["formats", "--suggest", "0.1"], "capture": ["capture", "--modes", "fp32"]}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_takes_plugin_and_refuses_a_broken_one(command, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dup.py").write_text(BROKEN["duplicate"][0])
    assert main([*COMMANDS[command], "--plugin", "dup.py"]) == 2
    err = capsys.readouterr().err
    assert f"error: plugin {tmp_path / 'dup.py'}: mode '0' is already registered" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dup.py"]


def test_save_first_layer_io_refuses_a_duplicate_plugin_in_a_subprocess(tmp_path):
    (tmp_path / "dup.py").write_text(BROKEN["duplicate"][0])
    r = subprocess.run([sys.executable, str(ROOT / "save_first_layer_io.py"), "--plugin", "dup.py", "--modes", "fp32"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == \
        f"error: plugin {tmp_path / 'dup.py'}: mode '0' is already registered"
    assert "Traceback" not in r.stderr and sorted(p.name for p in tmp_path.iterdir()) == ["dup.py"]


def test_a_module_plugin_by_dotted_name(tmp_path, monkeypatch, capsys):
    pkg = tmp_path / "plugtest_lab"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "recipes.py").write_text(doc_plugin())
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["modes", "--plugin", "plugtest_lab.recipes"]) == 0
    assert any(line.startswith("w8a16 ") for line in capsys.readouterr().out.splitlines())
    assert plugins.load_plugins(["plugtest_lab.recipes"]) == [sys.modules["plugtest_lab.recipes"]]  # once
    assert main(["modes", "--plugin", "plugtest_lab.nothing"]) == 2
    assert "error: plugin plugtest_lab.nothing: no module named 'plugtest_lab.nothing'" in capsys.readouterr().err
    assert main(["modes", "--plugin", "not a module"]) == 2
    assert "neither a .py file nor a dotted module name" in capsys.readouterr().err


def test_a_family_or_architecture_registered_twice_is_named(tmp_path):
    twice = tmp_path / "twice.py"
    twice.write_text("from harness.recipes.registry import Recipe, register_recipe\n"
                     "class F(Recipe):\n    name = 'float'\nregister_recipe(F())\n")
    with pytest.raises(plugins.PluginError, match=re.escape(f"plugin {twice}: recipe 'float' is already registered")):
        plugins.load_plugins([str(twice)])
    with pytest.raises(plugins.PluginError, match="recipe 'float'"):  # asked again: the same error, not re-run
        plugins.load_plugins([str(twice)])
    arch = tmp_path / "arch.py"
    arch.write_text("from harness.architectures.registry import get_architecture, register_architecture\n"
                    "register_architecture(get_architecture('mamba2'))\n")
    with pytest.raises(plugins.PluginError, match=re.escape(f"plugin {arch}: architecture 'mamba2' is already")):
        plugins.load_plugins([str(arch)])


def test_an_exporter_plugin_writes_the_export_directory(model, tmp_path):
    plugin = tmp_path / "exp.py"
    plugin.write_text(
        "from harness.recipes.registry import Exporter, register_exporter\n"
        "def run(cfg, ckpt, windows, directory, emit, progress):\n"
        "    (directory / 'toy.txt').write_text(f'{ckpt.dims.n_layer} {tuple(windows.shape)}')\n"
        "register_exporter(Exporter('toy', 'mamba1', run))\n")
    out = tmp_path / "out"
    argv = ["export", "--plugin", str(plugin), "--model", str(model), "--output_dir", str(out),
            "--calib_data_num", "4", "--calib_seqlen", "16", "--no_cache", "--recipe"]
    assert main([*argv, "toy"]) == 0
    assert (out / "toy.txt").read_text() == "2 (4, 16)" and (out / "tokenizer.json").is_file()
    assert main([*argv[:6], str(tmp_path / "o2"), *argv[7:], "nope"]) == 2
    assert not (tmp_path / "o2").exists()


class FakeEntryPoints:
    """importlib.metadata.entry_points(group=...) of an installed distribution with plugin entry points."""

    def __init__(self, *specs: tuple[str, str]) -> None:
        self.eps = [importlib.metadata.EntryPoint(name, value, plugins.ENTRY_POINT_GROUP) for name, value in specs]
        self.groups: list[str] = []

    def __call__(self, **kw):
        self.groups.append(kw.get("group"))
        return self.eps if kw.get("group") == plugins.ENTRY_POINT_GROUP else []


def test_entry_points_load_once_and_their_modes_are_listed(tmp_path, monkeypatch, capsys):
    (tmp_path / "plugtest_ep_w8a16.py").write_text(doc_plugin())
    (tmp_path / "plugtest_ep_fn.py").write_text(
        "CALLS = []\ndef register():\n    from harness.recipes.registry import register_mode, get_mode\n"
        "    from dataclasses import replace\n    CALLS.append(1)\n"
        "    register_mode(replace(get_mode('1'), name='fp16-again'))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fake = FakeEntryPoints(("w8a16", "plugtest_ep_w8a16"), ("again", "plugtest_ep_fn:register"))
    monkeypatch.setattr(importlib.metadata, "entry_points", fake)
    assert plugins.load_entry_points() == ["w8a16", "again"]
    assert plugins.load_entry_points() == ["w8a16", "again"] and sys.modules["plugtest_ep_fn"].CALLS == [1]
    assert fake.groups == ["quamba_harness.plugins"] * 2
    assert {"w8a16", "fp16-again"} <= set(registry.list_modes())
    assert main(["modes"]) == 0  # no --plugin: the installed entry points
    assert any(line.startswith("fp16-again ") for line in capsys.readouterr().out.splitlines())


def test_a_failing_entry_point_is_exit_2_naming_it(tmp_path, monkeypatch, capsys):
    (tmp_path / "plugtest_ep_bad.py").write_text("import plugtest_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(importlib.metadata, "entry_points", FakeEntryPoints(("bad", "plugtest_ep_bad")))
    with pytest.raises(plugins.PluginError, match=r"entry point 'bad' \(plugtest_ep_bad\) of the group "
                                                  r"quamba_harness.plugins failed to import: ModuleNotFoundError"):
        plugins.load_entry_points()
    assert main(["points"]) == 2
    err = capsys.readouterr().err
    assert "error: plugin entry point 'bad'" in err and "plugtest_missing_dependency" in err


CALIBRATED = '''
from harness.modes import ModeRecipe
from harness.recipes.registry import Recipe, register_recipe
from harness.runner.calibration import CalibrationResult

SEEN = []


class Amax(Recipe):
    """A family with a calibration of its own: fp16 blocks whose in_proj weight is divided by the layer's scale."""
    name = "amax-test"
    modes = (ModeRecipe("amax", "fp16, in_proj over a calibrated number", weights="fp16", rotate="no", norm_out="fp",
                        in_proj_out="fp", conv_in="static", conv_out="fp32", ssm_u="fp32", ssm_impl="reference",
                        had_out="fp", act_dtype="fp16", prep="exact", family="amax-test"),)

    def calibration_key(self, mode):
        return "amax-test"

    def calibrate(self, key, bank, windows, settings, depth, prefix_hashes, cache_dir, *, progress=None):
        SEEN.append((key, int(windows.numel())))
        return CalibrationResult([2.0] * (depth + 1), {"prep": key, "source": "computed", "tokens": int(windows.numel())})

    def build_blocks(self, mode, bank, scales, depth, calibration=False):
        blocks = super().build_blocks(mode, bank, None, depth, calibration)
        for block, s in zip(blocks, scales):
            block.in_proj.weight = block.in_proj.weight / s
        return blocks


register_recipe(Amax())
'''


def test_a_plugin_family_with_its_own_calibration_gets_its_scales(model, tmp_path):
    """recipe_for(mode).calibration_key/calibrate decide, not the knobs: a float-knob mode of a family with a
    calibration of its own reads the calibration text, gets its result in its blocks and in the stats."""
    plugin = tmp_path / "amax.py"
    plugin.write_text(CALIBRATED)
    out = tmp_path / "run" / "run.npz"
    assert capture(out, "--model", model, "--plugin", plugin, "--modes", "1", "amax", "--reference", "1") == 0
    stats = json.loads(out.with_name("run_stats.json").read_text())
    info = stats["provenance"]["calibration_by_prep"]["amax-test"]
    assert info["source"] == "computed" and info["tokens"] > 0
    assert stats["modes"]["amax"]["status"] == "ok" and stats["modes"]["amax"]["recipe"]["family"] == "amax-test"
    cap = load_capture(out)
    assert not np.array_equal(cap.array("amax", "output"), cap.array("1", "output"))  # the scale reached in_proj
