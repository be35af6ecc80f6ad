"""House rules that a grep can prove: import direction, named rounding, no unsafe deserialization."""
import ast
import re
import shutil
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
    "lmeval": 11.5,                               # lm-evaluation-harness: the quamba-harness model, eval runs
    "cli": 12, "__main__": 13,                    # the command line
}
# Inside emulation the ops are pure: they import nothing but the spec and each other.
OPS_MAY_IMPORT = {"spec"}


def module_name(path: Path, root: Path = PKG) -> str:
    """harness/runner/pipeline.py -> runner.pipeline; a package's __init__.py is the package (runner), the
    harness package's own is __init__."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "__init__"


def _is_module(root: Path, parts: list[str]) -> bool:
    where = root.joinpath(*parts)
    return bool(parts) and (where.with_suffix(".py").is_file() or (where / "__init__.py").is_file())


def harness_imports(path: Path, root: Path = PKG) -> list[tuple[str, str | None, int]]:
    """Every harness import of a module, at module level or inside a function, relative or absolute:
    (module, name, line), name the imported object where it is not a module itself ("from .capture import
    POINTS": ("emulation.capture", "POINTS", line); "from . import capture": ("emulation.capture", None, line))."""
    package = list(path.relative_to(root).parts[:-1])  # an __init__.py's package is its own folder
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(".".join(a.name.split(".")[1:]) or "__init__", None, node.lineno)
                      for a in node.names if a.name.split(".")[0] == "harness"]
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package[: len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
        elif (node.module or "").split(".")[0] == "harness":
            base = node.module.split(".")[1:]
        else:
            continue
        for alias in node.names:
            sub = base + [alias.name]
            found.append((".".join(sub), None, node.lineno) if _is_module(root, sub)
                         else (".".join(base) or "__init__", alias.name, node.lineno))
    return found


ALL_MODULES = sorted(PKG.rglob("*.py"))  # package __init__.py files and __main__.py included
SOURCES = sorted(p for p in ALL_MODULES if p.name not in ("__init__.py", "__main__.py"))


def harness_copy(tmp_path: Path) -> Path:
    """A copy of harness/ to write a probe module into (the rules take the root they check)."""
    return Path(shutil.copytree(PKG, tmp_path / "harness", ignore=shutil.ignore_patterns("__pycache__")))


def _package(module: str) -> str:
    """The ranked unit a module belongs to: a registry module, else its top-level package."""
    return next((u for u in RANKS if "." in u and (module == u or module.startswith(u + "."))), module.split(".")[0])


def rank_problems(path: Path, root: Path = PKG) -> list[str]:
    """The imports of a module that do not point down (RANKS), and a kernel's imports beyond OPS_MAY_IMPORT."""
    name = module_name(path, root)
    package = _package(name)
    if package not in RANKS:
        return [f"{name} is in no ranked package"]
    imported = [(m, line) for m, _, line in harness_imports(path, root)]
    problems = [f"{name} (rank {RANKS[package]}) imports {m} (rank {RANKS[_package(m)]}) at line {line}"
                for m, line in imported if _package(m) != package and RANKS[_package(m)] >= RANKS[package]]
    if package == "kernels":
        problems += [f"kernel {name} imports {m} at line {line}" for m, line in imported
                     if _package(m) != "kernels" and m not in OPS_MAY_IMPORT]
    return problems


@pytest.mark.parametrize("path", ALL_MODULES, ids=module_name)
def test_imports_point_down(path):
    assert not rank_problems(path)


def test_the_top_level_is_small_and_every_package_ranked():
    top = sorted(p.stem for p in PKG.glob("*.py")) + sorted(p.name for p in PKG.iterdir() if (p / "__init__.py").exists())
    assert len([t for t in top if t not in ("__init__", "__main__")]) <= 16, top
    assert set(top) <= {u.split(".")[0] for u in RANKS}, set(top) - set(RANKS)


def test_the_ranking_rule_catches_an_upward_import(tmp_path):
    """A module of the emulation that imported the runner would be refused (the rule is not vacuous), and so
    would a package's __init__.py that did, or a kernel that imported the emulation inside a function."""
    root = harness_copy(tmp_path)
    (root / "emulation" / "_upward_probe.py").write_text("from ..runner.pipeline import run\n")
    (root / "emulation" / "__init__.py").write_text('"""emulation"""\nfrom harness.runner import pipeline\n')
    (root / "kernels" / "_probe.py").write_text("def f():\n    from ..emulation import capture\n")
    assert rank_problems(root / "emulation" / "_upward_probe.py", root) == \
        ["emulation._upward_probe (rank 4) imports runner.pipeline (rank 10) at line 1"]
    assert rank_problems(root / "emulation" / "__init__.py", root) == \
        ["emulation (rank 4) imports runner.pipeline (rank 10) at line 2"]
    assert rank_problems(root / "kernels" / "_probe.py", root) == \
        ["kernels._probe (rank 3) imports emulation.capture (rank 4) at line 2",
         "kernel kernels._probe imports emulation.capture at line 2"]


def test_nothing_imports_cli():
    for path in ALL_MODULES:
        if _package(module_name(path)) not in ("cli", "__main__"):
            assert not any(_package(m) == "cli" for m, _, _ in harness_imports(path)), path


@pytest.mark.parametrize("path", SOURCES, ids=module_name)
def test_no_unnamed_rounding_outside_kernels_rounding(path):
    if module_name(path) == "kernels.rounding":
        return
    assert not re.search(r"torch\.round\(|\.round\(\)|\.round_\(", path.read_text())


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=module_name)
def test_no_unsafe_deserialization(path):
    text = path.read_text()
    assert not re.search(r"pickle\.load|allow_pickle=True|weights_only=False", text)
    for call in re.findall(r"torch\.load\([^)]*\)", text):
        assert "weights_only=True" in call


@pytest.mark.parametrize("path", SOURCES, ids=module_name)
def test_module_size_and_all(path):
    text = path.read_text()
    assert len(text.splitlines()) <= 420, f"{path.name} is over the ~400-line limit"
    assert "__all__" in text


@pytest.mark.parametrize("path", SOURCES, ids=module_name)
def test_no_function_takes_more_than_seven_positional_parameters(path):
    """Longer parameter lists become keyword-only or a parameter object (runner.context, runner.forwards.Forward)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            positional = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
            assert len(positional) <= 7, f"{node.name} (line {node.lineno}) takes {len(positional)} positionally"


def test_test_modules_have_unique_basenames():
    """pytest imports each test folder's modules by basename (no __init__.py): two test files of one name in two
    folders stop the whole collection ("import file mismatch"), as tests/lmeval/test_generate.py did."""
    tests = Path(__file__).resolve().parent
    names = [p.name for p in tests.rglob("*.py") if p.name != "conftest.py" and "fixtures" not in p.parts]
    assert sorted({n for n in names if names.count(n) > 1}) == []
