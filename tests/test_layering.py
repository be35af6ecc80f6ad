"""House rules that a grep can prove: import direction, named rounding, no unsafe deserialization."""
import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "harness"

# The architecture as ranks: a module may import the harness modules of a lower rank, and those of its
# own unit (a package's modules are one unit; the two registries are units of their own, below everything
# that registers into them). Top-level modules are packages of their own.
RANKS = {
    "spec": 0, "modes": 0, "__init__": 0,         # the numeric spec, modes as knob values; the lazy names (no imports)
    "architectures.registry": 1,                  # the Architecture protocol and registry
    "recipes.registry": 1.5,                      # the Recipe protocol, the mode and recipe registry
    "plugins": 1.7,                               # --plugin and the entry points: imports a user's module
    "runtime": 2,                                 # signals, the output lock, start-up, memory, the machine
    "kernels": 3,                                 # the pure ops, each with its *_ref twin
    "emulation": 4,                               # generic modules, observers' hooks, capture points, GPTQ
    "architectures": 5,                           # one folder per block architecture: config, weights, blocks
    "formats": 6,                                 # the public face of kernels.formats (FORMATS, fake_quantize)
    "metrics": 6,                                 # error metrics, percentiles, logits, intervals, compare
    "store": 7,                                   # the file format and safe files
    "checkpoints": 8,                             # float checkpoints, text, the weight bank's source
    "report": 9,                                  # the text tables and the HTML report (reads files only)
    "runner": 10,                                 # a run: pipeline, mode loop, studies; asks the registries
    "recipes": 11,                                # one folder per recipe family: calibration, blocks, checkpoints
    "cli": 12, "__main__": 13,                    # the command line
}
# Inside emulation the ops are pure: they import nothing but the spec and each other.
OPS_MAY_IMPORT = {"spec"}


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(PKG).with_suffix("").parts)


def _harness_imports(path: Path) -> set[str]:
    name = _module_name(path)
    package = name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            base = package[: len(package) - (node.level - 1)] + (node.module.split(".") if node.module else [])
            for alias in node.names:  # "from .ops import portable" imports the module ops.portable
                sub = PKG.joinpath(*base, alias.name + ".py")
                found.add(".".join(base + [alias.name]) if sub.exists() else ".".join(base))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("harness"):
            found.add(node.module.removeprefix("harness").lstrip(".") or "__init__")
    return {f or "__init__" for f in found}


SOURCES = sorted(p for p in PKG.rglob("*.py") if p.name not in ("__init__.py", "__main__.py"))


def _package(module: str) -> str:
    """The ranked unit a module belongs to: a registry module, else its top-level package."""
    return next((u for u in RANKS if "." in u and (module == u or module.startswith(u + "."))), module.split(".")[0])


@pytest.mark.parametrize("path", SOURCES, ids=_module_name)
def test_imports_point_down(path):
    name = _module_name(path)
    package = _package(name)
    assert package in RANKS, f"{name} is in no ranked package"
    for imported in _harness_imports(path):
        other = _package(imported)
        assert other == package or RANKS[other] < RANKS[package], \
            f"{name} (rank {RANKS[package]}) imports {imported} (rank {RANKS[other]})"
    if name.startswith("kernels."):
        assert {i for i in _harness_imports(path) if not i.startswith("kernels")} <= OPS_MAY_IMPORT, name


def test_the_top_level_is_small_and_every_package_ranked():
    top = sorted(p.stem for p in PKG.glob("*.py")) + sorted(p.name for p in PKG.iterdir() if (p / "__init__.py").exists())
    assert len([t for t in top if t not in ("__init__", "__main__")]) <= 15, top
    assert set(top) <= {u.split(".")[0] for u in RANKS}, set(top) - set(RANKS)


def test_the_ranking_rule_catches_an_upward_import(tmp_path):
    """A module of the emulation that imported the runner would be refused (the rule is not vacuous)."""
    bad = PKG / "emulation" / "_upward_probe.py"
    try:
        bad.write_text("from ..runner.pipeline import run\n")
        with pytest.raises(AssertionError, match="imports runner.pipeline"):
            test_imports_point_down(bad)
    finally:
        bad.unlink()


def test_nothing_imports_cli():
    for path in SOURCES:
        if _package(_module_name(path)) != "cli":
            assert not any(_package(m) == "cli" for m in _harness_imports(path)), path


@pytest.mark.parametrize("path", SOURCES, ids=_module_name)
def test_no_unnamed_rounding_outside_kernels_rounding(path):
    if _module_name(path) == "kernels.rounding":
        return
    assert not re.search(r"torch\.round\(|\.round\(\)|\.round_\(", path.read_text())


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=_module_name)
def test_no_unsafe_deserialization(path):
    text = path.read_text()
    assert not re.search(r"pickle\.load|allow_pickle=True|weights_only=False", text)
    for call in re.findall(r"torch\.load\([^)]*\)", text):
        assert "weights_only=True" in call


@pytest.mark.parametrize("path", SOURCES, ids=_module_name)
def test_module_size_and_all(path):
    text = path.read_text()
    assert len(text.splitlines()) <= 420, f"{path.name} is over the ~400-line limit"
    assert "__all__" in text


@pytest.mark.parametrize("path", SOURCES, ids=_module_name)
def test_no_function_takes_more_than_seven_positional_parameters(path):
    """Longer parameter lists become keyword-only or a parameter object (runner.context, runner.forwards.Forward)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            positional = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
            assert len(positional) <= 7, f"{node.name} (line {node.lineno}) takes {len(positional)} positionally"
