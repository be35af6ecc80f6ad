"""User plugins: ``--plugin FILE_OR_MODULE`` and the entry-point group ``quamba_harness.plugins`` (docs/plugins.md).

A plugin is Python code that registers recipe families, modes, checkpoint formats, exporters or architectures
into the registries (``harness.recipes.registry``, ``harness.architectures.registry``) when it is imported:

* a file (``my_recipe.py``, any path ending in ``.py`` or naming a file) is imported under a module name made
  from its absolute path (``quamba_harness_plugin_<stem>_<hash>``): the same in every process, so a worker that
  loads the same file unpickles the plugin's objects by that name;
* a dotted module name (``mypkg.recipes``) is imported as usual (it must be on ``sys.path``);
* an entry point of the group ``quamba_harness.plugins`` names a module (imported) or a function (called
  with no arguments) of an installed distribution.

Each is loaded once per process: loading it again does nothing. A plugin that fails to import (any exception,
a ``SyntaxError`` too) or registers a name that is taken is a ``PluginError`` naming the plugin and the problem;
the command lines turn it into exit 2. The built-in families and architectures are registered first, so a
plugin can neither shadow nor be shadowed by them.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import re
import sys
import traceback
from importlib import metadata
from pathlib import Path
from types import ModuleType

from .architectures.registry import ArchitectureError
from .recipes.registry import RegistryError, load_builtins

__all__ = ["PluginError", "ENTRY_POINT_GROUP", "FILE_MODULE_PREFIX", "load_plugins", "load_entry_points", "load_all",
           "canonical", "loaded_modules"]

ENTRY_POINT_GROUP = "quamba_harness.plugins"
FILE_MODULE_PREFIX = "quamba_harness_plugin_"  # the module name of a plugin file: this, its stem, a hash of its path
_PACKAGE = str(Path(__file__).resolve().parent) + "/"
_MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")

_LOADED: dict[str, ModuleType | None] = {}  # canonical spec (or entry point) -> its module (None: a function)
_FAILED: dict[str, "PluginError"] = {}      # a plugin that failed fails the same way when asked again


class PluginError(ValueError):
    """A plugin that cannot be loaded: not found, raised while importing, or registered a taken name."""


def _is_file(spec: str) -> bool:
    return spec.endswith(".py") or "/" in spec or "\\" in spec or Path(spec).is_file()


def canonical(spec: str) -> str:
    """The spec as every process reads it the same way: a file's absolute path, or the module name."""
    spec = spec.strip()
    return str(Path(spec).expanduser().resolve()) if _is_file(spec) else spec


def _problem(where: str, e: BaseException) -> PluginError:
    """The PluginError of `where` for the exception its import raised."""
    if isinstance(e, (RegistryError, ArchitectureError)):
        return PluginError(f"plugin {where}: {e}")
    if isinstance(e, SyntaxError):
        at = f"{Path(e.filename or where).name} line {e.lineno}"
        return PluginError(f"plugin {where} has a syntax error: {e.msg} ({at})")
    # where the plugin's own code raised: the deepest frame of a file, outside the harness and importlib
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not f.filename.startswith(("<", _PACKAGE)) and "importlib" not in Path(f.filename).parts]
    at = f" (at {Path(frames[-1].filename).name} line {frames[-1].lineno})" if frames else ""
    return PluginError(f"plugin {where} failed to import: {type(e).__name__}: {e}{at}")


def _module_name(path: Path) -> str:
    stem = re.sub(r"\W", "_", path.stem)
    return f"{FILE_MODULE_PREFIX}{stem}_{hashlib.sha256(str(path).encode()).hexdigest()[:12]}"


def _import_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise PluginError(f"plugin {path}: no such file (--plugin takes a .py file or a dotted module name)")
    name = _module_name(path)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise PluginError(f"plugin {path}: not a Python file that can be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _import_module(name: str) -> ModuleType:
    if not _MODULE_RE.match(name):
        raise PluginError(f"plugin {name!r}: neither a .py file nor a dotted module name (e.g. mypkg.recipes)")
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
            raise PluginError(f"plugin {name}: no module named {e.name!r} "
                              "(is it installed, or on PYTHONPATH?)") from None
        raise


def _load(key: str, where: str, load) -> ModuleType | None:
    """load() once for `key`; every failure as a PluginError naming `where`."""
    if key in _LOADED:
        return _LOADED[key]
    if key in _FAILED:
        raise _FAILED[key]
    load_builtins()  # the built-in names are taken before any plugin registers
    try:
        value = load()
    except PluginError:  # not found: not cached, the file or module may appear later
        raise
    except (Exception, SystemExit) as e:  # SyntaxError too; KeyboardInterrupt stays an interruption
        _FAILED[key] = _problem(where, e)
        raise _FAILED[key] from None
    _LOADED[key] = value
    return value


def load_plugins(specs: list[str] | tuple[str, ...]) -> list[ModuleType]:
    """Import each FILE_OR_MODULE of `specs` (once per process); their modules, in order."""
    out = []
    for spec in specs:
        key = canonical(spec)
        if _is_file(spec):
            out.append(_load(key, key, lambda: _import_file(Path(key))))
        else:
            out.append(_load(key, key, lambda: _import_module(key)))
    return out


def load_entry_points() -> list[str]:
    """Load every entry point of the group ``quamba_harness.plugins`` (once per process): a module is imported,
    a ``module:function`` is called with no arguments. Their names, in order."""
    names = []
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        where = f"entry point {ep.name!r} ({ep.value}) of the group {ENTRY_POINT_GROUP}"
        _load(f"entry point {ep.name} = {ep.value}", where, lambda ep=ep: _entry_point(ep))
        names.append(ep.name)
    return names


def _entry_point(ep) -> ModuleType | None:
    value = ep.load()
    if isinstance(value, ModuleType):
        return value
    if callable(value):
        value()
    return None


def load_all(specs: list[str] | tuple[str, ...] = ()) -> None:
    """The installed entry points, then `specs` (what a command line or a worker loads before resolving modes)."""
    load_entry_points()
    load_plugins(specs)


def loaded_modules() -> dict[str, ModuleType]:
    """canonical spec (or entry point) -> module, for every plugin module loaded in this process."""
    return {k: m for k, m in _LOADED.items() if m is not None}
