"""One op computed once per run: a module of a later mode, configured as an earlier one and given
bit-identical inputs, takes the result computed then instead of computing it again.

The modes of a run share much of their computation. Of the eight built-in modes, six run the same
norm and in_proj on the same codes (``0`` and ``2-x``), four the same int8 conv (``0``, ``2-0``,
``2-1``, ``2-2``), and two pairs the same scan (``2-0`` re-quantizes u losslessly, so it scans what
``0`` scans; ``2-1`` and ``2-2`` likewise), whose outputs are then bit-identical down to the block
output. Every op of the emulation is deterministic on the CPU (same inputs, same thread count, same
result), so taking the earlier result changes no number; ``tests/runner/test_reuse.py`` proves that every
array of every mode equals the one computed without sharing, bit for bit.

Two calls are the same when the modules are of one class and hold the same settings (tensors and
QTensors: the same objects, which the run's WeightBank shares between modes; everything else equal;
a module with forward hooks is never shared, its hooks must see every call) and every input
is bit-identical: the same object, a view of the same memory, or equal bit patterns (QTensors: the
same scale and codes; a -0.0 is not a 0.0, a NaN matches only the same NaN bits). Settings that
are not tensors (output rules, orders, epsilons) compare with ``==``. A hit returns the earlier result
object itself, so the next op's input is that object and matches at once. Ops never write into
their inputs or results after returning them (``modules`` and ``ops`` allocate what they write).

Results are kept until ``max_bytes`` (inputs held only as views of kept results cost nothing more);
beyond it calls are computed as usual and not kept, so a deep run shares its first layers only.
A result is kept only for those who can take it: the mode loop sets ``keep`` per mode (False when no mode
after it has its prepared weights, so none can match its weighted ops: no Mamba-2 built-in mode shares with
another) and ``release``s a weight variant's calls when its last mode is done.
"""
from __future__ import annotations

import dataclasses
import struct
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..spec import QTensor

__all__ = ["SharedOps", "DEFAULT_MAX_BYTES"]

DEFAULT_MAX_BYTES = 256 << 20


def _same_float(a, b) -> bool:
    """Equal values; Python floats by their bits (a -0.0 is not a 0.0, the same NaN bits match)."""
    if isinstance(a, float):
        return type(b) is float and struct.pack("<d", a) == struct.pack("<d", b)
    return a == b


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a is b:
        return True
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    if (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.storage_offset() == b.storage_offset()
            and a.stride() == b.stride()):
        return True  # the same memory seen the same way
    if a.dtype.is_floating_point:  # bit patterns: -0.0 differs from 0.0, NaN payloads count
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.view(bits), b.view(bits)
    # the last position first (a view): another sample's or mode's input differs there at once, and
    # a run of many samples compares each call with every kept one of its settings
    if a.dim() >= 2 and a.shape[-2] > 1 and not torch.equal(a.select(-2, -1), b.select(-2, -1)):
        return False
    return torch.equal(a, b)


def _same_value(a, b) -> bool:
    """Bit-identical operands or settings (a result's n_clipped is never read by an op: not compared)."""
    if isinstance(a, QTensor) or isinstance(b, QTensor):
        return isinstance(a, QTensor) and isinstance(b, QTensor) and _same_float(a.scale, b.scale) \
            and _same_tensor(a.codes, b.codes)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _same_tensor(a, b)
    return type(a) is type(b) and _same_float(a, b)


def _settings(module: torch.nn.Module) -> dict:
    """What a module computes with: its class and its own attributes (weights, output rule, order ...)."""
    return {"class": type(module), **{k: v for k, v in vars(module).items() if not k.startswith("_") and k != "training"}}


def _holds_tensors(x) -> bool:
    """A prepared weight of several tensors (kernels.int4.Int4Weight): compared as a tensor is, by identity (its
    ``==`` would compare the tensors element-wise)."""
    return dataclasses.is_dataclass(x) and not isinstance(x, type) and \
        any(isinstance(getattr(x, f.name), torch.Tensor) for f in dataclasses.fields(x))


def _same_settings(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k, x in a.items():
        y = b[k]
        if isinstance(x, (torch.Tensor, QTensor)) or isinstance(y, (torch.Tensor, QTensor)) or \
                _holds_tensors(x) or _holds_tensors(y):
            if x is not y:  # weights: the very same prepared object (held here, so never a reused id)
                return False
        elif not _same_value(x, y):
            return False
    return True


def _storages(x) -> dict[int, int]:
    """data_ptr -> bytes of every storage behind a value (QTensors, tensors, tuples of them)."""
    if isinstance(x, QTensor):
        return _storages(x.codes)
    if isinstance(x, torch.Tensor):
        return {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes()}
    if isinstance(x, (tuple, list)):
        return {k: v for item in x for k, v in _storages(item).items()}
    return {}


@dataclass
class _Call:
    settings: dict
    args: tuple
    result: object
    tag: object = None


@dataclass
class SharedOps:
    """The kept calls of one run, by (layer, op name); ``calls`` and ``reused`` (by op name) count what happened."""

    max_bytes: int = DEFAULT_MAX_BYTES
    kept_bytes: int = 0
    calls: int = 0
    reused: Counter = field(default_factory=Counter)
    _calls: dict[tuple[int, str], list[_Call]] = field(default_factory=dict)
    _held: set[int] = field(default_factory=set)  # data_ptr of every storage the kept calls hold
    keep: bool = True  # keep new results (the mode loop: only when a later mode could take them)
    tag: object = None  # what the kept calls are tagged with, for release (the mode loop: the weight variant)

    def call(self, layer: int, op: str, module: torch.nn.Module | None, fn, *args):
        """fn(*args), or the result of an earlier call of the same op with the same settings (the module's
        attributes; None: a function without any) and inputs."""
        self.calls += 1
        if module is not None and (module._forward_hooks or module._forward_pre_hooks):
            return fn(*args)  # its hooks must see the call: never shared
        settings = {} if module is None else _settings(module)
        kept = self._calls.setdefault((layer, op), [])
        for c in kept:
            if _same_settings(c.settings, settings) and len(c.args) == len(args) \
                    and all(_same_value(a, b) for a, b in zip(c.args, args)):
                self.reused[op] += 1
                return c.result
        result = fn(*args)
        new = {k: v for k, v in _storages((args, result)).items() if k not in self._held}
        if self.keep and self.kept_bytes + sum(new.values()) <= self.max_bytes:
            kept.append(_Call(settings, args, result, self.tag))
            self.kept_bytes += sum(new.values())
            self._held.update(new)
        return result

    def release(self, live: set) -> None:
        """Drop the kept calls whose tag is not in `live` (their bytes no longer count)."""
        self._calls = {k: [c for c in calls if c.tag in live] for k, calls in self._calls.items()}
        held = {k: v for calls in self._calls.values() for c in calls for k, v in _storages((c.args, c.result)).items()}
        self._held, self.kept_bytes = set(held), sum(held.values())

    def summary(self) -> dict:
        return {"calls": self.calls, "reused": sum(self.reused.values()), "reused_by_op": dict(sorted(self.reused.items())),
                "kept_mb": round(self.kept_bytes / 2**20, 1), "max_mb": round(self.max_bytes / 2**20, 1)}
