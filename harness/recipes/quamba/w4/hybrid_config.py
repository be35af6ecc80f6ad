"""Quamba2's W4AX per-layer config (``--hybrid_blocks_config``): which Mamba-2 layer runs W4A8 and which W4A16.

Upstream (enyac-group/Quamba c474646): ``quantize_model_mamba`` reads the file with ``json.load``
(quamba/modelutils_mamba.py:837-840) and ``quantize_fp16_model_act_hybrid`` builds layer i only as the entry
``layer_wise_hybrid_config[i]`` ("W4A8" or "W4A16", the keys of ``quant_function_pairs``, :674-681 and :703-714);
without a config every layer holds both and runs the first, W4A8 (:715-732). The shipped configs are JSON lists of
strings, one per layer (configs/hybrid/mamba2-8b/hybrid_blocks_config.json).

The harness checks the file before any work (upstream would fail with a KeyError or IndexError, or silently use
only the first entries of a longer list): a JSON list of "W4A8"/"W4A16" strings (``read_blocks_config``), as long as
the model has layers (``length_problem``).
"""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["BLOCK_KINDS", "DEFAULT_BLOCK", "MAX_CONFIG_BYTES", "read_blocks_config", "config_problem",
           "length_problem", "layer_blocks"]

BLOCK_KINDS = ("W4A8", "W4A16")  # quant_function_pairs' keys (modelutils_mamba.py:674-681)
DEFAULT_BLOCK = "W4A8"  # no config: set_mixer(next(iter(mixers))), the first of a8, a16 (:674, :732)
MAX_CONFIG_BYTES = 1 << 20


def read_blocks_config(path: str | Path) -> list[str]:
    """The per-layer list of the config file at `path`; ValueError naming what is wrong and what is valid."""
    p = Path(path)
    valid = f'a JSON list of {" or ".join(map(repr, BLOCK_KINDS))}, one per layer, e.g. ["W4A8", "W4A16", "W4A8"]'
    if not p.exists():
        raise ValueError(f"blocks_config {str(p)!r} does not exist; give {valid}")
    if not p.is_file():
        raise ValueError(f"blocks_config {str(p)!r} is not a regular file; give {valid}")
    try:
        if p.stat().st_size > MAX_CONFIG_BYTES:
            raise ValueError(f"blocks_config {str(p)!r} is larger than 1 MiB; give {valid}")
        data = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"cannot read blocks_config {str(p)!r}: {e.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"blocks_config {str(p)!r} is not valid JSON ({e}); give {valid}") from None
    if not isinstance(data, list) or not data:
        what = "an empty list" if data == [] else f"a JSON {type(data).__name__}"
        raise ValueError(f"blocks_config {str(p)!r} holds {what}; give {valid}")
    bad = [f"layer {i}: {v!r}" for i, v in enumerate(data) if not isinstance(v, str) or v not in BLOCK_KINDS]
    if bad:
        raise ValueError(f"blocks_config {str(p)!r} has unknown entries ({', '.join(bad[:5])}"
                         f"{', ...' if len(bad) > 5 else ''}); valid entries: {', '.join(BLOCK_KINDS)}")
    return list(data)


def config_problem(path: str | None) -> str | None:
    """What is wrong with the config file (read_blocks_config's message), or None (no file: every layer W4A8)."""
    if path is None:
        return None
    try:
        read_blocks_config(path)
    except ValueError as e:
        return str(e)
    return None


def length_problem(path: str | None, n_layer: int) -> str | None:
    """The config must name every layer of the model, no more, no fewer (upstream indexes it by layer, :705)."""
    if path is None:
        return None
    n = len(read_blocks_config(path))
    if n == n_layer:
        return None
    return (f"blocks_config {path!r} names {n} layer(s), but the model has {n_layer} Mamba-2 layers; valid: a list "
            f"of {n_layer} entries, each {' or '.join(BLOCK_KINDS)}")


def layer_blocks(path: str | None, n_layer: int) -> list[str]:
    """Per layer "W4A8" or "W4A16": the config's list, or W4A8 everywhere without one (upstream's default)."""
    return [DEFAULT_BLOCK] * n_layer if path is None else read_blocks_config(path)
