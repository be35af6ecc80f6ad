"""House rules that a grep can prove: import direction, named rounding, no unsafe deserialization."""
import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "harness"

# module -> harness modules it may import (STYLE.md (c), adapted to this package's files)
ALLOWED = {
    "spec": set(),
    "memory": set(),
    "machine": set(),
    "ops.quant": {"spec"},
    "ops.linear": {"spec", "ops.quant"},
    "ops.portable": {"ops.quant"},
    "ops.conv1d": {"spec", "ops.quant", "ops.portable"},
    "ops.scan": {"spec", "ops.quant", "ops.portable"},
    "ops.hadamard": set(),
    "percentiles": set(),
    "metrics": {"percentiles"},
    "guard": set(),
    "files": {"guard"},
    "storage": {"files", "guard"},
    "capture": {"spec"},
    "observers": {"ops.quant"},
    "reuse": {"spec"},
    "modules": {"spec", "ops.conv1d", "ops.hadamard", "ops.linear", "ops.quant", "ops.portable", "ops.scan", "reuse"},
    "modes": set(),
    "loading": {"spec"},
    "data": {"files", "loading"},
    "weights": {"spec", "loading", "memory", "ops.hadamard", "ops.quant"},
    "build": {"spec", "modes", "modules", "weights", "ops.hadamard", "ops.linear", "ops.scan"},
    "calibration": {"spec", "build", "guard", "modes", "observers", "weights"},
    "quamba_ckpt": {"spec", "loading", "ops.quant", "weights"},
    "quamba_pair": {"calibration", "loading", "quamba_ckpt", "weights"},
    "export": {"build", "calibration", "data", "loading", "modes", "modules", "observers", "ops.quant", "quamba_ckpt",
               "spec", "weights"},
    "compare": {"metrics"},
    "intervals": set(),
    "endmetrics": set(),
    "runchecks": set(),
    "collect": {"compare", "storage"},
    "analysis": {"build", "capture", "memory", "metrics", "modes", "modules", "ops.hadamard", "ops.linear", "ops.quant", "spec",
                 "reuse", "storage", "weights"},
    "samples": {"analysis", "capture", "compare", "endmetrics", "guard", "intervals", "metrics", "report", "storage"},
    "report": set(),
    "resume": {"files", "guard", "modes", "storage"},
    "runmodes": {"analysis", "calibration", "capture", "collect", "guard", "metrics", "modes", "report", "reuse",
                 "runchecks", "samples", "storage"},
    "pipeline": {"__init__", "spec", "analysis", "build", "calibration", "capture", "compare", "data", "loading", "metrics",
                 "modes", "files", "guard", "quamba_pair", "report", "resume", "runmodes", "samples", "storage", "collect",
                 "weights", "machine"},
        # the HTML report: the top of the layering, reads files only through storage
    "htmlreport.figures": set(),
    "htmlreport.html": set(),
    "htmlreport.data": {"compare", "metrics", "storage"},
    "htmlreport.sections": {"htmlreport.data", "htmlreport.figures", "htmlreport.html"},
    "htmlreport.build": {"compare", "storage", "htmlreport.data", "htmlreport.figures", "htmlreport.html",
                         "htmlreport.sections"},
    "cli": {"calibration", "capture", "compare", "data", "export", "files", "guard", "modes", "pipeline", "report",
            "storage", "htmlreport.build"},
}


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


@pytest.mark.parametrize("path", SOURCES, ids=_module_name)
def test_imports_point_down(path):
    name = _module_name(path)
    assert name in ALLOWED, f"{name} is not in the layer table"
    extra = _harness_imports(path) - ALLOWED[name]
    assert not extra, f"{name} imports {sorted(extra)}"


def test_nothing_imports_cli():
    for path in SOURCES:
        if _module_name(path) != "cli":
            assert "cli" not in _harness_imports(path), path


@pytest.mark.parametrize("path", SOURCES, ids=_module_name)
def test_no_unnamed_rounding_outside_ops_quant(path):
    if _module_name(path) == "ops.quant":
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
