"""Fake-quantization points on the float blocks of an architecture, and the observers that calibrate them.

The field's other recipes (harness/recipes/naive, smq, mambaquant; docs/field-recipes.md) quantize an fp
model at named points: a linear layer's input or output, a slice of it, the scan's B, C and z. ``Wrap`` puts
functions (fake quantizers, smoothing divisions, rotations, observers) around a block's module without
changing the block: the block still calls ``module(*args)`` and ``module.step(*args)``, and its HookPoints
(the capture sites) see what they saw, so every metric of the harness reads these recipes as it reads Quamba's.

``wrap_mamba1`` and ``wrap_mamba2`` place a table of point name -> function on an ``EmuMambaBlock`` /
``EmuMamba2Block`` (the point names of the Quamba1 simulated path, enyac-group/Quamba@624361b
quamba/fake_quant/qMambaLayer.py:90-99 and qSelectiveScan.py:41; see POINTS_MAMBA1 / POINTS_MAMBA2).

Observers (``AmaxObserver``, ``ChannelAmaxObserver``, ``CovarianceObserver``) are functions of the same kind
that record a statistic and return their input unchanged: a calibration is the recipe's own block with
observers at its points, run over the calibration windows.
"""
from __future__ import annotations

import itertools
from typing import Callable

import torch
from torch import nn

__all__ = ["Wrap", "wrap_mamba1", "wrap_mamba2", "POINTS_MAMBA1", "POINTS_MAMBA2", "AmaxObserver",
           "ChannelAmaxObserver", "CovarianceObserver", "split_last", "compose"]

Fn = Callable[[torch.Tensor], torch.Tensor]
_SERIAL = itertools.count()

# point -> (the block's module, "in" argument index or "out")
POINTS_MAMBA1: dict[str, tuple[str, int | str]] = {
    "in_proj.in": ("in_proj", 0), "in_proj.out": ("in_proj", "out"), "conv.in": ("conv1d", 0),
    "conv.out": ("conv1d", "out"), "x_proj.in": ("x_proj", 0), "x_proj.out": ("x_proj", "out"),
    "dt_proj.in": ("dt_proj", 0), "dt_proj.out": ("dt_proj", "out"), "scan.u": ("ssm", 0),
    "scan.B": ("ssm", 2), "scan.C": ("ssm", 3), "scan.z": ("ssm", 4), "scan.y": ("ssm", "out"),
    "out_proj.in": ("out_proj", 0), "out_proj.out": ("out_proj", "out"),
}
POINTS_MAMBA2: dict[str, tuple[str, int | str]] = {
    "in_proj.in": ("in_proj", 0), "in_proj.out": ("in_proj", "out"), "conv.out": ("conv1d", "out"),
    "out_proj.in": ("out_proj", 0), "out_proj.out": ("out_proj", "out"),
}


def compose(*fns: Fn | None) -> Fn | None:
    """fns applied left to right (None entries skipped); None when there is none."""
    real = [f for f in fns if f is not None]
    if not real:
        return None

    def run(x):
        for f in real:
            x = f(x)
        return x
    return run


def split_last(sizes: list[int], fns: list[Fn | None]) -> Fn:
    """x -> cat(fn_i(x_i)) over consecutive slices of the last dim of the given sizes (None: the slice as is)."""
    def run(x: torch.Tensor) -> torch.Tensor:
        parts = x.split(sizes, dim=-1)
        return torch.cat([p if f is None else f(p) for p, f in zip(parts, fns)], dim=-1)
    return run


class Wrap(nn.Module):
    """`inner` with functions on its positional inputs (ins[i] on argument i; None: unchanged) and on its output
    (the first element of a tuple output). The conv's extra methods (quantize_input, step_input, window_of) pass
    through. Never shared between modes (runner.sharedops compares a module's attributes: ``serial`` is unique)."""

    def __init__(self, inner: nn.Module, ins: dict[int, Fn], out: Fn | None) -> None:
        super().__init__()
        self.inner, self.ins, self.out_fn, self.serial = inner, dict(ins), out, next(_SERIAL)

    def _args(self, args: tuple) -> list:
        return [self.ins[i](a) if i in self.ins else a for i, a in enumerate(args)]

    def _result(self, r):
        if self.out_fn is None:
            return r
        if isinstance(r, tuple):
            return (self.out_fn(r[0]),) + tuple(r[1:])
        return self.out_fn(r)

    def forward(self, *args):
        return self._result(self.inner(*self._args(args)))

    def step(self, *args):
        return self._result(self.inner.step(*self._args(args)))

    def quantize_input(self, x):
        return self.inner.quantize_input(x)

    def step_input(self, x):
        return self.inner.step_input(x)

    def window_of(self, x_in, x_conv):
        return self.inner.window_of(x_in, x_conv)

    @property
    def state_rule(self):
        """The wrapped scan's (the block hands its state over by it: emulation.state.ssm_handover)."""
        return self.inner.state_rule


def _place(block: nn.Module, table: dict[str, tuple[str, int | str]], fns: dict[str, Fn | None]) -> nn.Module:
    unknown = sorted(set(fns) - set(table))
    if unknown:
        raise ValueError(f"unknown fake-quantization point(s) {', '.join(unknown)}; valid: {', '.join(table)}")
    by_module: dict[str, tuple[dict[int, Fn], list[Fn]]] = {}
    for point, fn in fns.items():
        if fn is None:
            continue
        module, where = table[point]
        ins, outs = by_module.setdefault(module, ({}, []))
        if where == "out":
            outs.append(fn)
        else:
            ins[where] = compose(ins.get(where), fn)
    for module, (ins, outs) in by_module.items():
        setattr(block, module, Wrap(getattr(block, module), ins, compose(*outs)))
    return block


def wrap_mamba1(block: nn.Module, fns: dict[str, Fn | None]) -> nn.Module:
    """An EmuMambaBlock with `fns` at its points (POINTS_MAMBA1); the block itself, changed."""
    return _place(block, POINTS_MAMBA1, fns)


def wrap_mamba2(block: nn.Module, fns: dict[str, Fn | None]) -> nn.Module:
    """An EmuMamba2Block with `fns` at its points (POINTS_MAMBA2); the block itself, changed."""
    return _place(block, POINTS_MAMBA2, fns)


class AmaxObserver:
    """Running max |x| over every call (Quamba1's observer.py:30-68 min-max, symmetric); returns x."""

    def __init__(self) -> None:
        self.amax = 0.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.amax = max(self.amax, float(x.detach().abs().max())) if x.numel() else self.amax
        return x


class ChannelAmaxObserver:
    """Running per-channel (last dim) max |x| over every other dim (smooth_quant_utils.py:34-71); returns x."""

    def __init__(self) -> None:
        self.amax: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.detach().abs().reshape(-1, x.shape[-1]).amax(dim=0).to(torch.float32)
        self.amax = m if self.amax is None else torch.maximum(self.amax, m)
        return x


class CovarianceObserver:
    """The tokens' sums for a float64 covariance of the last dim (sum x, sum x x^T, count); returns x."""

    def __init__(self) -> None:
        self.n, self.s, self.ss = 0, None, None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        t = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
        self.n += t.shape[0]
        self.s = t.sum(0) if self.s is None else self.s + t.sum(0)
        self.ss = t.T @ t if self.ss is None else self.ss + t.T @ t
        return x

    def covariance(self) -> torch.Tensor:
        """The unbiased covariance (torch.cov's); NaN entries when fewer than 2 tokens were seen."""
        if self.n == 0:
            return torch.full((1, 1), float("nan"), dtype=torch.float64)
        mean = self.s / self.n
        return (self.ss - self.n * torch.outer(mean, mean)) / (self.n - 1) if self.n > 1 else \
            torch.full_like(self.ss, float("nan"))
