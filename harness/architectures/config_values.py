"""config.json values read by type, for every architecture's layout (docs/models.md, "config.json values").

A size must be a JSON integer: ``2``, or a number that is one exactly (``12.0`` is read as 12); a string
(``"2"``), a fraction (``2.5``), ``Infinity``/``NaN`` or a table is refused, naming the key. A missing
required key is named with the layout that needs it. ``check_config_tables`` checks the keys that say which
layout a config is (``architectures``, ``model_type``, ``ssm_cfg``) before any of them is looked into.
An integer literal too long for Python's int (over 4300 digits) is parsed to ``OversizedInt`` (``parse_int``),
so that the key holding it can be named too.
"""
from __future__ import annotations

import math
import sys

from .registry import architecture_names, get_architecture

__all__ = ["REQUIRED", "ConfigValueError", "OversizedInt", "parse_int", "config_int", "config_table", "check_config_tables",
           "supported_model_types", "supported_classes"]


def supported_model_types() -> tuple[str, ...]:
    """The transformers model types the harness computes: those its registered architectures declare
    (Architecture.model_types); anything else (jamba, a falcon_mamba before its architecture existed, ...) is
    refused by name, never computed as another family. mamba_ssm configs carry no model_type."""
    return tuple(t for name in architecture_names() for t in get_architecture(name).model_types)


def supported_classes() -> tuple[str, ...]:
    """The ``architectures`` class names the registered architectures declare (Architecture.class_names)."""
    return tuple(c for name in architecture_names() for c in get_architecture(name).class_names)

REQUIRED = object()  # config_int's default for a key that must be there
_MAX_DIGITS = 4000  # below Python's int-string limit (sys.get_int_max_str_digits(), 4300 by default)


class ConfigValueError(ValueError):
    """A config.json value of the wrong type, or a missing key; the message names the key and what is valid."""


class OversizedInt:
    """An integer literal of config.json too long to read (its digit count only)."""

    def __init__(self, digits: int) -> None:
        self.digits = digits

    def __repr__(self) -> str:
        return f"an integer of {self.digits} digits"


def parse_int(text: str) -> int | OversizedInt:
    """json.loads' parse_int: int(text), or OversizedInt for a literal over the int-string limit."""
    limit = min(_MAX_DIGITS, sys.get_int_max_str_digits() or _MAX_DIGITS)
    digits = len(text.lstrip("-"))
    return OversizedInt(digits) if digits > limit else int(text)


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def config_int(table: dict, key: str, default=REQUIRED, *, prefix: str = "", layout: str = "") -> int:
    """table[key] as an int: a JSON integer, or a float that is exactly one (12.0); a missing (or null) key
    takes `default`; a missing required key names `layout` (what needs it)."""
    if key not in table or (table[key] is None and default is not REQUIRED):
        if default is REQUIRED:
            raise ConfigValueError(f"{prefix + key!r} is missing" + (f"; {layout} needs it" if layout else ""))
        return default
    value = table[key]
    if type(value) is int:
        return value
    if type(value) is float and math.isfinite(value) and value.is_integer():
        return int(value)
    raise ConfigValueError(f"{prefix + key!r} must be an integer (a JSON number such as 2, or 2.0), "
                           f"got {_show(value)}")


def config_table(table: dict, key: str, *, prefix: str = "") -> dict:
    """table[key] as a table (a JSON object); missing or null: {}."""
    value = table.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigValueError(f"{prefix + key!r} must be a table (a JSON object such as {{\"d_state\": 16}}), "
                               f"got {_show(value)}")
    return value


def check_config_tables(cfg: dict) -> None:
    """The keys that say which layout a config is: architectures (a list of class names the harness
    implements), model_type (a string, one the harness implements), ssm_cfg (a table); and no integer literal too long to read, wherever it is."""
    archs = cfg.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise ConfigValueError(f"'architectures' must be a list of class names (e.g. [\"MambaForCausalLM\"]), "
                               f"got {_show(archs)}")
    if cfg.get("model_type") is not None and not isinstance(cfg["model_type"], str):
        raise ConfigValueError(f"'model_type' must be a string (e.g. \"mamba\" or \"mamba2\"), "
                               f"got {_show(cfg['model_type'])}")
    kind, types, classes = cfg.get("model_type"), supported_model_types(), supported_classes()
    if kind is not None and kind not in types:
        raise ConfigValueError(f"model_type {kind!r} is not supported; supported model types: "
                               f"{', '.join(types)} (or a mamba_ssm config without model_type)")
    unknown = [a for a in archs or () if a not in classes]
    if unknown:
        raise ConfigValueError(f"architectures entry {unknown[0]!r} is not supported; supported: "
                               f"{', '.join(classes)}")
    config_table(cfg, "ssm_cfg")
    where = _oversized(cfg)
    if where is not None:
        raise ConfigValueError(f"{where[0]!r} is {where[1]!r}, too long to read; sizes are integers up to 2^20")


def _oversized(cfg: dict) -> tuple[str, OversizedInt] | None:
    """(dotted key, value) of the first OversizedInt in cfg, searched without recursion."""
    todo = [("", cfg)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, OversizedInt):
            return path, value
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        todo += [(f"{path}.{k}" if path else str(k), v) for k, v in items]
    return None
