"""Recipes by name: the ``Recipe`` a family of modes implements, the modes themselves, and where both are registered.

A recipe family (``float``, ``quamba1``, ``quamba2``, ``quamba2-w4``, or a plugin's) is one folder under
``harness/recipes/`` whose ``__init__`` registers a ``Recipe``: which modes it owns, the architectures each runs
on, its calibration (one per calibration key, shared by the modes with that key), how it builds a block of an
architecture, and optionally its checkpoint formats and exports. A mode (``modes.ModeRecipe``: knob values) is
owned by the family its ``family`` field names, or, for the built-in families, by the first whose ``owns``
accepts its knobs. The run never names a recipe: it asks ``recipe_for(mode)``. This module imports only the
modes and the architecture registry; the built-in folders are imported by name on first use (``load_builtins``).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..architectures.registry import architecture_names, get_architecture
from ..architectures.registry import load_builtins as load_architectures
from ..modes.files import load_modes_file
from ..modes.knobs import PRESETS, ModeError
from ..modes.recipe import ModeRecipe
from ..modes.registry import BUILTIN_MODES

__all__ = ["Recipe", "CheckpointFormat", "Exporter", "register_recipe", "register_mode", "register_checkpoint_format",
           "register_exporter", "recipe_for", "recipe_names", "get_recipe", "checkpoint_formats", "exporters",
           "get_exporter", "on_architecture", "architectures_of", "ModeRegistry", "resolve_modes", "get_mode",
           "list_modes", "architecture_problem", "load_builtins", "BUILTIN_RECIPES", "RegistryError"]

# the built-in folders, imported by name so that this module stays below them
BUILTIN_RECIPES = ("harness.recipes.float", "harness.recipes.quamba", "harness.recipes.se", "harness.recipes.naive",
                   "harness.recipes.smq", "harness.recipes.mambaquant")


class RegistryError(ModeError):
    """A name registered twice, or a mode that names an unknown recipe family."""


class Recipe:
    """A family of modes. Subclass it, set ``name`` (the family's one identifier: the registry, ``modes``'s listing,
    a mode's ``family`` field and with it the stats' recipe) and ``title``, and override what the family does differently; the defaults are a float recipe's.

    ``modes``: the modes the family brings (registered with it); ``owns(mode)``: whether a mode whose ``family``
    field is empty belongs to it (built-in families only; a plugin's modes name their family).
    """

    name: str = ""
    title: str = ""
    modes: tuple[ModeRecipe, ...] = ()

    def owns(self, mode: ModeRecipe) -> bool:
        return mode.family == self.name

    def architectures(self, mode: ModeRecipe) -> tuple[str, ...]:
        """The architectures `mode` runs on (default: every registered one)."""
        return tuple(architecture_names())

    def architecture_problem(self, mode: ModeRecipe, architecture: str) -> str | None:
        """Why `mode` cannot run on `architecture`, or None."""
        runs = self.architectures(mode)
        return None if architecture in runs else f"recipe {self.name!r} runs on {', '.join(runs)}"

    def mode_problem(self, mode: ModeRecipe) -> str | None:
        """What is wrong with `mode`'s own settings (its ``options``), or None; asked when the modes are resolved,
        before any work (default: a mode of this family takes no options)."""
        return f"recipe {self.name!r} takes no options" if mode.options else None

    def calibration_problem(self, mode: ModeRecipe, settings) -> str | None:
        """Why `mode` cannot calibrate with these settings (runner.calibration.CalibrationSettings), or None; asked
        with model_problem, before any work (default: None)."""
        return None

    def model_problem(self, mode: ModeRecipe, dims) -> str | None:
        """Why `mode` cannot run on this model (its dims: a ModelDims or Mamba2Dims), or None; asked by the run
        right after the model is opened, before any work (default: None)."""
        return None

    def on_architecture(self, mode: ModeRecipe, architecture: str | None) -> ModeRecipe:
        """The mode as it runs on `architecture` (default: unchanged)."""
        return mode

    def calibration_key(self, mode: ModeRecipe) -> str | None:
        """The calibration `mode` reads (modes with one key share one calibration), None when it needs none."""
        return mode.calibration_key if mode.needs_calibration else None

    def calibrate(self, key: str, bank, windows, settings, depth: int, prefix_hashes: list[str],
                  cache_dir: Path | None, *, progress=None):
        """The calibration `key` of layers 0..depth (a ``runner.calibration.CalibrationResult``)."""
        raise NotImplementedError(f"recipe {self.name!r} has no calibration")

    def build_blocks(self, mode: ModeRecipe, bank, scales, depth: int, calibration: bool = False) -> list:
        """Blocks 0..depth of `mode` (default: the architecture's own knob interpreter)."""
        return get_architecture(bank.dims.architecture).build_blocks(mode, bank, scales, depth, calibration)

    def after_calibration(self, calibs: dict, modes: list[ModeRecipe], bank, windows, settings,
                          cache_dir: Path | None, progress) -> None:
        """Called once per run with every calibration done (key -> result or the exception it raised) and the
        run's modes: what the family observes beyond its blocks' scales goes into a result's info."""

    def extra_knobs(self, mode: ModeRecipe) -> dict | None:
        """What the family's mode does beyond its ModeRecipe knobs, recorded as the stats' ``family_knobs`` (flat
        name -> string), or None (default)."""
        return None

    def decode_problem(self, mode: ModeRecipe) -> str | None:
        """Why `mode` cannot run --decode or --generate (its forward is prefill-only), or None (default)."""
        return None

    def embedding(self, mode: ModeRecipe, bank, rotate: bool, dtype) -> Callable | None:
        """ids -> the residual stream's first value, or None for the bank's float embedding."""
        return None


@dataclass(frozen=True)
class CheckpointFormat:
    """A quantized checkpoint layout a family reads: ``detect(directory)`` says whether a directory is one (it
    may raise the reader's input error for a broken one); ``open(directory)`` reads it; ``check_pair(models,
    depth)`` says how well it and the float model given beside it belong together (runner.pairing.Models)."""

    name: str
    detect: Callable[[Path], bool]
    open: Callable[[Path], Any]
    check_pair: Callable[..., dict] | None = None


@dataclass(frozen=True)
class Exporter:
    """``export --recipe NAME`` of a model of `architecture`: ``run(cfg, ckpt, windows, directory, emit, progress)``
    writes the checkpoint into the new `directory` (cfg: runner.export.ExportConfig; ckpt: the float checkpoint;
    windows: the calibration token ids), which the command then moves into place (docs/plugins.md); ``check(cfg,
    dims)``: the whole message of what it refuses of a model (None: fine), asked before any work; ``summary(out)``:
    the line printed once the directory is in place."""

    name: str
    architecture: str
    run: Callable[..., Any]
    check: Callable[..., str | None] | None = None
    summary: Callable[[Path], str] | None = None


_RECIPES: dict[str, Recipe] = {}
_EXTRA_MODES: dict[str, ModeRecipe] = {}
_FORMATS: dict[str, CheckpointFormat] = {}
_EXPORTERS: dict[tuple[str, str], Exporter] = {}
_loaded = False


def load_builtins() -> None:
    """Import the built-in architecture and recipe folders once (each registers itself)."""
    global _loaded
    if not _loaded:
        _loaded = True
        load_architectures()
        for module in BUILTIN_RECIPES:
            importlib.import_module(module)


def register_recipe(recipe: Recipe) -> Recipe:
    """Add a family and its modes; a family or mode name that is taken is a ``RegistryError``."""
    load_builtins()
    if not recipe.name:
        raise RegistryError(f"{type(recipe).__name__} has no name")
    if recipe.name in _RECIPES:
        raise RegistryError(f"recipe {recipe.name!r} is already registered")
    for mode in recipe.modes:
        _check_free(mode.name)
    _RECIPES[recipe.name] = recipe
    for mode in recipe.modes:
        _EXTRA_MODES[mode.name] = mode
    return recipe


def register_mode(mode: ModeRecipe) -> ModeRecipe:
    """Add one mode (its ``family`` names a registered recipe, or a built-in family owns its knobs)."""
    load_builtins()
    _check_free(mode.name)
    recipe_for(mode)
    _EXTRA_MODES[mode.name] = mode
    return mode


def _check_free(name: str) -> None:
    if name in BUILTIN_MODES or name in _EXTRA_MODES:
        raise RegistryError(f"mode {name!r} is already registered")


def register_checkpoint_format(fmt: CheckpointFormat) -> CheckpointFormat:
    if fmt.name in _FORMATS:
        raise RegistryError(f"checkpoint format {fmt.name!r} is already registered")
    _FORMATS[fmt.name] = fmt
    return fmt


def register_exporter(exporter: Exporter) -> Exporter:
    key = (exporter.name, exporter.architecture)
    if key in _EXPORTERS:
        raise RegistryError(f"exporter {exporter.name!r} for {exporter.architecture} is already registered")
    _EXPORTERS[key] = exporter
    return exporter


def recipe_names() -> list[str]:
    load_builtins()
    return list(_RECIPES)


def get_recipe(name: str) -> Recipe:
    load_builtins()
    if name not in _RECIPES:
        raise RegistryError(f"unknown recipe {name!r}; valid: {', '.join(_RECIPES)}")
    return _RECIPES[name]


def recipe_for(mode: ModeRecipe) -> Recipe:
    """The family that runs `mode`."""
    load_builtins()
    if mode.family:
        if mode.family not in _RECIPES:
            raise RegistryError(f"mode {mode.name!r} names recipe {mode.family!r}, which is not registered; "
                                f"valid: {', '.join(_RECIPES)}")
        return _RECIPES[mode.family]
    for recipe in _RECIPES.values():
        if recipe.owns(mode):
            return recipe
    raise RegistryError(f"no registered recipe runs mode {mode.name!r}")


def checkpoint_formats() -> list[CheckpointFormat]:
    load_builtins()
    return list(_FORMATS.values())


def exporters() -> list[Exporter]:
    load_builtins()
    return list(_EXPORTERS.values())


def get_exporter(name: str, architecture: str) -> Exporter | None:
    load_builtins()
    return _EXPORTERS.get((name, architecture))


def on_architecture(mode: ModeRecipe, architecture: str | None) -> ModeRecipe:
    """`mode` as it runs on a model of `architecture` (its family may change knobs there)."""
    return recipe_for(mode).on_architecture(mode, architecture)


def architectures_of(mode: ModeRecipe) -> tuple[str, ...]:
    return recipe_for(mode).architectures(mode)


def architecture_problem(mode: ModeRecipe, architecture: str) -> str | None:
    """Why `mode` cannot run on a model of `architecture`, or None when it can."""
    return recipe_for(mode).architecture_problem(mode, architecture)


class ModeRegistry:
    """Name -> mode: the built-in modes, the registered ones (plugins), and a run's own (``--modes_file``)."""

    def __init__(self) -> None:
        load_builtins()
        self._modes: dict[str, ModeRecipe] = {**BUILTIN_MODES, **_EXTRA_MODES}

    def register(self, recipe: ModeRecipe, replace_existing: bool = False) -> None:
        if recipe.name in self._modes and not replace_existing:
            raise ModeError(f"mode {recipe.name!r} is already defined; built-in modes: {', '.join(BUILTIN_MODES)}")
        recipe_for(recipe)
        self._modes[recipe.name] = recipe

    def get(self, name: str) -> ModeRecipe:
        if name not in self._modes:
            raise ModeError(f"unknown mode {name!r}; valid: {', '.join(self._modes)} "
                            f"(presets: {', '.join(PRESETS)})")
        return self._modes[name]

    def names(self) -> list[str]:
        return list(self._modes)

    def resolve(self, requested: list[str], architecture: str | None = "mamba1") -> list[ModeRecipe]:
        """Expand presets, keep order, drop duplicates, validate every name (and that it runs on `architecture`;
        None: the model is not known yet, the names only are checked, presets as on the first architecture)."""
        names: list[str] = []
        presets = get_architecture(architecture or architecture_names()[0]).presets
        for item in requested:
            if item in presets and not presets[item]:
                raise ModeError(f"preset {item!r} has no modes for a {architecture} model; valid there: "
                                + "; ".join(f"{k} = {' '.join(v)}" for k, v in presets.items() if v))
            for name in presets.get(item, (item,)):
                if name not in names:
                    names.append(name)
        if not names:
            raise ModeError(f"no modes given; valid: {', '.join(self._modes)} (presets: {', '.join(PRESETS)})")
        recipes = [on_architecture(self.get(n), architecture) for n in names]
        for r in recipes:
            if (why := recipe_for(r).mode_problem(r)) is not None:
                raise ModeError(f"mode {r.name!r}: {why}")
        for r in recipes if architecture is not None else ():
            if (why := architecture_problem(r, architecture)) is not None:
                runs = [n for n in self._modes if architecture_problem(self._modes[n], architecture) is None]
                raise ModeError(f"mode {r.name!r} does not run on a {architecture} model: {why}; "
                                f"valid there: {', '.join(runs)}")
        return recipes


def resolve_modes(requested: list[str], modes_file: Path | None = None,
                  architecture: str | None = "mamba1") -> list[ModeRecipe]:
    """Mode names/presets -> modes, with the user modes of ``modes_file`` (JSON or TOML) added; a mode that does
    not run on `architecture` (the model's, spec.ModelDims.architecture) is a ModeError."""
    registry = ModeRegistry()
    if modes_file is not None:
        for recipe in load_modes_file(modes_file, {**BUILTIN_MODES, **_EXTRA_MODES}):
            registry.register(recipe)
    return registry.resolve(requested, architecture)


def get_mode(name: str) -> ModeRecipe:
    """A registered mode by name (a run's own modes come in through ``resolve_modes``)."""
    return ModeRegistry().get(name)


def list_modes() -> list[str]:
    return ModeRegistry().names()
