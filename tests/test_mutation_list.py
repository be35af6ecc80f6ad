"""`make mutation` mutates what pyproject.toml lists, and that list holds every module of the emulation core
(a module added under harness/emulation without joining it would never be mutated: the tools kept their own
list, which the modules of this wave were missing from)."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from mutation import MODULES  # noqa: E402
from mutation_report import CORE  # noqa: E402


def test_every_emulation_module_is_mutated_and_reported_as_core():
    emulation = {".".join(p.relative_to(ROOT).with_suffix("").parts) for p in (ROOT / "harness" / "emulation").rglob("*.py")
                 if p.name != "__init__.py"}
    assert emulation <= set(MODULES), sorted(emulation - set(MODULES))
    assert emulation <= CORE
    assert "harness.store.reader" in MODULES and "harness.store.reader" not in CORE


def test_every_listed_module_exists():
    for m in MODULES:
        assert (ROOT / (m.replace(".", "/") + ".py")).is_file(), m
