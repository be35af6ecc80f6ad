"""`make mutation` mutates what pyproject.toml lists, and that list holds every module of the emulation core
(a module added under harness/emulation without joining it would never be mutated: the tools kept their own
list, which the modules of this wave were missing from)."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from mutation import MODULES  # noqa: E402
from mutation_report import CORE  # noqa: E402


def _modules(package: str, inits: bool = False) -> set[str]:
    return {".".join(p.relative_to(ROOT).with_suffix("").parts) for p in (ROOT / "harness" / package).rglob("*.py")
            if inits or p.name != "__init__.py"}


def test_every_emulation_module_is_mutated_and_reported_as_core():
    """Every module of the kernels, the emulation and the architectures (their __init__ registers the knob
    interpreter and the weight preparation), and the registries, are mutated and count as the core."""
    core = _modules("kernels") | _modules("emulation") | _modules("architectures", inits=True)
    core -= {"harness.kernels.__init__", "harness.architectures.__init__"}
    core |= {"harness.recipes.registry", "harness.runner.backbone"}
    assert core <= set(MODULES), sorted(core - set(MODULES))
    assert core <= CORE, sorted(core - CORE)
    assert "harness.store.reader" in MODULES and "harness.store.reader" not in CORE


def test_every_listed_module_exists():
    for m in MODULES:
        assert (ROOT / (m.replace(".", "/") + ".py")).is_file(), m
