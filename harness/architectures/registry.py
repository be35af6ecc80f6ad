"""The block architectures a model can have, by name: what the run asks of one, and where they are registered.

An architecture (``mamba1``, ``mamba2``, or a plugin's) is one folder under ``harness/architectures/`` whose
``__init__`` registers an ``Architecture``: its name, its dimensions type (``spec.ModelDims`` or a subclass,
whose class attribute ``architecture`` is the name), its capture-site table, its presets, and how its float
blocks are built from a recipe (the knob interpreter of that block). The run never names an architecture: it
asks ``get_architecture(dims.architecture)``. Built-in folders are imported on first use of the registry
(``load_builtins``); plugins register theirs when they are imported (``harness.plugins``).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["Architecture", "ArchitectureError", "register_architecture", "get_architecture", "architecture_names",
           "load_builtins", "BUILTIN_ARCHITECTURES"]

# the built-in folders, imported by name so that this module stays below them
BUILTIN_ARCHITECTURES = ("harness.architectures.mamba1", "harness.architectures.mamba2",
                         "harness.architectures.falcon_mamba", "harness.architectures.bamba")


class ArchitectureError(ValueError):
    """An unknown architecture, or one registered twice."""


@dataclass(frozen=True)
class Architecture:
    """One block architecture.

    name: its identifier (``ModelDims.architecture``); title: one line for listings; points: the capture-site
    table (site -> what it holds); presets: preset name -> mode names on this architecture; build_blocks:
    ``(recipe, bank, scales, depth, calibration) -> [block 0, ..., block depth]`` for the recipes whose
    arithmetic is the block's own knob interpreter (floating point, and Quamba1's W8A8 on Mamba-1); it
    raises ``ValueError`` for a recipe the block cannot take; prepare_layer: ``(raw, weights, rotate, prep, fp16)
    -> params``, one block's weights as a recipe needs them (raw(): the checkpoint's tensors; fp16(): the same
    block's fp16 variant, for int8 weights quantized from it); extra: what a recipe may ask of it by key
    (``formats``: its blocks apply the number-format knobs, True for all of them or a tuple of those it applies;
    ``layer_formats``: ``(recipe, dims, layer) -> dict``, what a block ran for the stats); open_config: ``(ckpt, config, error) -> bool``, the
    float checkpoint reader of the architecture's own layout: True when `config` (config.json) is one of its
    models, after it has set the just-indexed checkpoint's tensor table, format and dims (checkpoints.loading
    asks every architecture that has one; the Mamba-1 layout is the loader's own); it raises `error` for a
    config or tensor it cannot use. model_types / class_names: the transformers ``model_type`` values and
    ``architectures`` class names of its checkpoints (config_values.check_config_tables accepts those of the
    registered architectures and refuses any other by name).
    """

    name: str
    title: str
    points: dict[str, str]
    build_blocks: Callable[..., list]
    prepare_layer: Callable[..., Any]
    presets: dict[str, tuple[str, ...]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    open_config: Callable[..., bool] | None = None
    model_types: tuple[str, ...] = ()
    class_names: tuple[str, ...] = ()


_ARCHITECTURES: dict[str, Architecture] = {}
_loaded = False


def register_architecture(arch: Architecture) -> Architecture:
    """Add `arch`; a name that is already registered is an ``ArchitectureError`` (nothing is replaced)."""
    if arch.name in _ARCHITECTURES:
        raise ArchitectureError(f"architecture {arch.name!r} is already registered")
    _ARCHITECTURES[arch.name] = arch
    return arch


def load_builtins() -> None:
    """Import the built-in architecture folders once (each registers itself)."""
    global _loaded
    if not _loaded:
        _loaded = True
        for module in BUILTIN_ARCHITECTURES:
            importlib.import_module(module)


def get_architecture(name: str) -> Architecture:
    load_builtins()
    if name not in _ARCHITECTURES:
        raise ArchitectureError(f"unknown architecture {name!r}; valid: {', '.join(_ARCHITECTURES)}")
    return _ARCHITECTURES[name]


def _builtin_place(arch: Architecture) -> int:
    """The place of a built-in architecture's folder in BUILTIN_ARCHITECTURES (its blocks are built there); a
    plugin's comes after them."""
    where = getattr(arch.build_blocks, "__module__", None) or ""
    return next((i for i, m in enumerate(BUILTIN_ARCHITECTURES) if where == m or where.startswith(m + ".")),
                len(BUILTIN_ARCHITECTURES))


def architecture_names() -> list[str]:
    """The registered names: the built-in ones first, in BUILTIN_ARCHITECTURES order whatever was imported first
    (the first is the default where a command has no model), then the plugins' in the order they registered."""
    load_builtins()
    return sorted(_ARCHITECTURES, key=lambda name: _builtin_place(_ARCHITECTURES[name]))
