"""The check every architecture's checkpoint reader runs on its block tensors (headers only): present unless
optional, floating point, of a shape its config.json implies; and the embedding's width.

A module directly under architectures/, beside the registry: the architecture folders import it, never each
other (tests/test_layering_graph.py).
"""
from __future__ import annotations

__all__ = ["check_block_shapes"]


def check_block_shapes(ckpt, expected: dict[str, set[tuple[int, ...]]], error: type[Exception] = ValueError, *,
                       model: str = "has", detail: str = "") -> None:
    """Every block tensor of a checkpoints.loading.Checkpoint against `expected` (name -> allowed shapes) and the
    embedding against d_model; `error` naming the first that does not fit. `model` words the block count
    ("config.json says the model {model} N blocks"), `detail` follows a shape mismatch."""
    d = ckpt.dims
    for layer in range(d.n_layer):
        for name in ckpt.layer_tensors:
            key = ckpt.layer_key(layer, name)
            if not ckpt.has(key):
                if name in ckpt.optional:
                    continue
                raise error(f"tensor {key!r} is missing; config.json says the model {model} {d.n_layer} blocks")
            got, dtype = ckpt.meta(key)
            if not dtype.is_floating_point:
                raise error(f"{key} has dtype {dtype}; weights must be floating point")
            if got not in expected[name]:
                want = " or ".join(str(list(s)) for s in sorted(expected[name], key=len, reverse=True))
                raise error(f"{key} has shape {list(got)}, but config.json implies {want}{detail}")
    width, dtype = ckpt.embedding().shape[1], ckpt.embedding().dtype
    if width != d.d_model or not dtype.is_floating_point:
        raise error(f"the embedding has width {width} and dtype {dtype}; it must be floating point of width "
                    f"d_model {d.d_model}")
