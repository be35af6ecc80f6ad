"""User mode files (--modes_file, JSON or TOML: each mode a base recipe with knobs changed) and the modes
of a run (names, presets and the file's modes)."""
from __future__ import annotations

import json
import tomllib
from dataclasses import replace
from pathlib import Path

from .knobs import FORMAT_KNOBS, KNOBS, Q2_HEAD_KNOBS, Q2_KNOBS, ModeError
from .recipe import ModeRecipe
from .registry import BUILTIN_MODES

__all__ = ["load_modes_file"]


def load_modes_file(path: Path, bases: dict[str, ModeRecipe] | None = None) -> list[ModeRecipe]:
    """Read user-defined modes.

    JSON: {"modes": {"NAME": {"base": "2-4", "title": "...", "conv_in": "dynamic"}}}
    TOML: [modes.NAME] base = "2-4"  title = "..."  conv_in = "dynamic"
    ``base`` (optional) names a built-in mode whose knobs are the defaults; without
    it every knob must be given, except ``prep`` (default: quamba for int8 weights, else exact).
    ``bases``: the modes a ``base`` may name (default: the built-in ones; the registry adds its families' modes).
    ``options`` (a table) sets a family's own settings (e.g. {"base": "smq-ssm", "options": {"alpha": 0.6}}).
    """
    path = Path(path)
    try:
        if not path.is_file() and path.exists():
            raise ModeError(f"modes file {path} is not a regular file; give a JSON or TOML file")
        if path.exists() and path.stat().st_size > 1 << 20:
            raise ModeError(f"modes file {path} is larger than 1 MiB; give a JSON or TOML file of mode recipes")
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ModeError(f"cannot read modes file {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ModeError(f"modes file {path} is not UTF-8 ({e.reason}); give a JSON or TOML file") from None
    try:
        data = tomllib.loads(text) if path.suffix.lower() == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ModeError(f"modes file {path} is not valid {'TOML' if path.suffix.lower() == '.toml' else 'JSON'}: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("modes"), dict) or set(data) - {"modes"}:
        raise ModeError(f"modes file {path} must hold one table 'modes' mapping mode names to knob tables, "
                        'e.g. {"modes": {"my-mode": {"base": "2-4", "conv_in": "dynamic"}}}')
    return [_user_recipe(path, name, spec, BUILTIN_MODES if bases is None else bases)
            for name, spec in data["modes"].items()]


def _user_recipe(path: Path, name: str, spec: object, bases: dict[str, ModeRecipe]) -> ModeRecipe:
    if not isinstance(spec, dict):
        raise ModeError(f"modes file {path}: mode {name!r} must be a table of knobs")
    valid_keys = ("base", "title", *KNOBS, *FORMAT_KNOBS, "layers", *Q2_KNOBS, *Q2_HEAD_KNOBS, "family", "options")
    unknown = [k for k in spec if k not in valid_keys]
    if unknown:
        raise ModeError(f"modes file {path}: mode {name!r} has unknown key(s) {', '.join(map(repr, unknown))}; "
                        f"valid keys: {', '.join(valid_keys)}")
    values = {k: v for k, v in spec.items() if k in KNOBS or k in FORMAT_KNOBS or k in Q2_KNOBS or k in Q2_HEAD_KNOBS
              or k == "family"}  # family: the recipe family that runs it (a plugin's, docs/plugins.md)
    bad = [k for k, v in values.items() if not isinstance(v, str)]
    if bad:
        raise ModeError(f"modes file {path}: mode {name!r}: knob values must be strings ({', '.join(bad)})")
    title = spec.get("title", f"user mode from {path.name}")
    if not isinstance(title, str):
        raise ModeError(f"modes file {path}: mode {name!r}: title must be a string, got {type(title).__name__}")
    if "base" in spec:
        base_name = spec["base"]
        if not isinstance(base_name, str) or base_name not in bases:
            raise ModeError(f"modes file {path}: mode {name!r}: unknown base {base_name!r}; "
                            f"valid: {', '.join(bases)}")
        return replace(bases[base_name], name=name, title=title, **values, **_layers_of(path, name, spec))
    if "prep" not in values:  # as the built-in modes: Quamba's preparation for int8 weights, exact otherwise
        values["prep"] = "quamba" if values.get("weights") == "int8" else "exact"
    missing = [k for k in KNOBS if k not in values]
    if missing:
        raise ModeError(f"modes file {path}: mode {name!r} lacks knob(s) {', '.join(missing)}; "
                        f"give them or name a built-in 'base' mode")
    return ModeRecipe(name=name, title=title, **values, **_layers_of(path, name, spec))


def _layers_of(path: Path, name: str, spec: dict) -> dict:
    out = {"layers": spec["layers"]} if "layers" in spec else {}
    if "options" in spec:
        if not isinstance(spec["options"], dict):
            raise ModeError(f"modes file {path}: mode {name!r}: options must be a table of a family's settings, "
                            f"e.g. {{\"alpha\": 0.5}}")
        out["options"] = spec["options"]
    return out
