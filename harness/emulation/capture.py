"""Capture sites, their names, and the hook context manager that records them.

A capture point is named ``L{layer}.{site}.{role}``: the block index, the module
site, and what is taken there. The sites form one closed table (POINTS), so
names are generated, parsed and sorted in one place; layers sort numerically.

This module is the one naming authority: every name of a captured tensor is derived here.

    module path   blocks.0.hooks.block_in   the HookPoint inside EmuBackbone (module_path, hook_attr)
    point         L0.block.in               point_name / parse_point
    tensor        input                     tensor_name: layer-0 block I/O keep the research tool's names
    npz key       mode_0_input              array_key / parse_array_key (store.format writes it)
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from ..architectures.registry import get_architecture
from ..spec import ChannelQTensor, HookPoint, QTensor

__all__ = ["POINTS", "DERIVED_POINTS", "ISOLATED", "TAP_POINTS", "BLOCK_IO", "RESIDUAL_BASIS", "point_name",
           "parse_point", "point_sort_key", "select_points", "Captured", "capture", "TapError", "LAYER_SPEC_RE",
           "resolve_layers", "hook_attr", "module_path", "RESEARCH_TENSORS", "tensor_name", "array_key",
           "parse_array_key", "STATE_POINTS", "DECODE_PREFIX", "decode_tensor", "decode_points", "decode_site",
           "MAMBA2_POINTS", "MIXER_NORM_POINTS", "NORMED_MAMBA1_POINTS", "ATTENTION_POINTS",
           "MLP_POINTS", "HYBRID_POINTS", "points_of",
           "tap_points_of"]

# point -> what it holds (docs/file-format.md "Capture points" lists the same words)
POINTS: dict[str, str] = {
    "block.in": "residual stream entering the block (layer 0: the embedding) [batch, seqlen, d_model]",
    "norm.out": "RMSNorm output = in_proj input [batch, seqlen, d_model]",
    "in_proj.out": "in_proj output, x then z [batch, seqlen, 2*d_inner]",
    "conv1d.in": "conv input as the conv uses it (after static/dynamic quantization) [batch, seqlen, d_inner]",
    "conv1d.out": "conv + SiLU output [batch, seqlen, d_inner]",
    "x_proj.in": "x_proj input (the conv output, re-quantized at s_u where the recipe says) [batch, seqlen, d_inner]",
    "x_proj.out": "x_proj output: dt_low, B, C [batch, seqlen, dt_rank+2*d_state]",
    "dt_proj.out": "dt_proj output before the bias and softplus [batch, seqlen, d_inner]",
    "ssm.u": "the scan's u input [batch, seqlen, d_inner]",
    "ssm.out": "scan output y, gated by SiLU(z) [batch, seqlen, d_inner]",
    "ssm.state": "final SSM state h_L [batch, d_inner, d_state]",
    "had.out": "online Hadamard output = out_proj input (rotated modes only) [batch, seqlen, d_inner]",
    "out_proj.out": "out_proj output = mixer output, in the model's own basis [batch, seqlen, d_model]",
    "block.out": "mixer output before the residual add [batch, seqlen, d_model]",
    "block.residual": "residual stream after the block [batch, seqlen, d_model]",
}
# The Mamba-2 block's sites (emulation.mamba2.EmuMamba2Block), named after mamba_ssm's Mamba2 / transformers'
# Mamba2Mixer; the residual-stream sites and norm.out, out_proj.out, had.out mean what they mean for Mamba-1.
MAMBA2_POINTS: dict[str, str] = {
    "block.in": POINTS["block.in"],
    "norm.out": POINTS["norm.out"],
    "in_proj.z": "in_proj output, the gate z [batch, seqlen, d_inner]",
    "in_proj.xBC": "in_proj output, x | B | C before the conv [batch, seqlen, d_inner + 2*ngroups*d_state]",
    "in_proj.dt": "in_proj output, dt before the bias and softplus [batch, seqlen, nheads]",
    "conv1d.x": "conv + SiLU output, the SSD's x [batch, seqlen, d_inner]",
    "conv1d.B": "conv + SiLU output, the SSD's B [batch, seqlen, ngroups*d_state]",
    "conv1d.C": "conv + SiLU output, the SSD's C [batch, seqlen, ngroups*d_state]",
    "ssd.dt": "softplus(dt + dt_bias), the SSD's time step [batch, seqlen, nheads]",
    "ssd.y": "SSD output with the D skip, before the gate [batch, seqlen, d_inner]",
    "ssd.state": "final SSD state [batch, nheads, headdim, d_state]",
    "gnorm.out": "gated group-wise RMSNorm output (norm(y * silu(z))) [batch, seqlen, d_inner]",
    "had.out": "online Hadamard of the gated norm output = out_proj input (rotated modes only) [batch, seqlen, d_inner]",
    "out_proj.out": POINTS["out_proj.out"],
    "block.out": POINTS["block.out"],
    "block.residual": POINTS["block.residual"],
}

# A Mamba-1 variant's weightless RMSNorms of x_proj's output parts (emulation.norms), after x_proj.out.
MIXER_NORM_POINTS: dict[str, str] = {
    "dt_norm.out": "weightless RMSNorm of dt_low = dt_proj input [batch, seqlen, dt_rank]",
    "b_norm.out": "weightless RMSNorm of B = the scan's B [batch, seqlen, d_state]",
    "c_norm.out": "weightless RMSNorm of C = the scan's C [batch, seqlen, d_state]",
}
_AFTER_XPROJ = list(POINTS).index("x_proj.out") + 1
NORMED_MAMBA1_POINTS: dict[str, str] = dict(list(POINTS.items())[:_AFTER_XPROJ] + list(MIXER_NORM_POINTS.items())
                                            + list(POINTS.items())[_AFTER_XPROJ:])

# A hybrid's attention and MLP blocks (architectures.bamba.block); norm.out is the block's input RMSNorm (the
# attention's input_layernorm, the MLP's pre_ff_layernorm), the residual-stream sites mean what they mean above.
ATTENTION_POINTS: dict[str, str] = {
    "block.in": POINTS["block.in"], "norm.out": POINTS["norm.out"],
    "attn.q": "queries after RoPE [batch, seqlen, n_heads, head_dim]",
    "attn.k": "keys after RoPE, as the KV cache holds them [batch, seqlen, n_kv_heads, head_dim]",
    "attn.v": "values, as the KV cache holds them [batch, seqlen, n_kv_heads, head_dim]",
    "attn.scores": "attention probabilities, softmax(q k^T / sqrt(head_dim) + causal mask) [batch, n_heads, seqlen, "
                   "seqlen] (the prefill only: a decode step's width grows with the cache)",
    "attn.out": "attention output = o_proj input [batch, seqlen, n_heads*head_dim]",
    "o_proj.out": "o_proj output = mixer output [batch, seqlen, d_model]",
    "block.out": POINTS["block.out"], "block.residual": POINTS["block.residual"],
}
MLP_POINTS: dict[str, str] = {
    "block.in": POINTS["block.in"], "norm.out": "pre-FFN RMSNorm output = gate and up input [batch, seqlen, d_model]",
    "mlp.gate": "gate_proj output [batch, seqlen, d_ff]", "mlp.up": "up_proj output [batch, seqlen, d_ff]",
    "mlp.hidden": "SiLU(gate) * up = down_proj input [batch, seqlen, d_ff]",
    "mlp.down": "down_proj output = the MLP's output [batch, seqlen, d_model]",
    "block.out": POINTS["block.out"], "block.residual": POINTS["block.residual"],
}
# a hybrid's site table: every kind's sites (a block has its kind's only)
_IO = ("block.in", "block.out", "block.residual")
HYBRID_POINTS: dict[str, str] = {
    "block.in": POINTS["block.in"],
    **{p: d for table in (MAMBA2_POINTS, ATTENTION_POINTS, MLP_POINTS) for p, d in table.items() if p not in _IO},
    "block.out": POINTS["block.out"], "block.residual": POINTS["block.residual"]}


def points_of(architecture: str) -> dict[str, str]:
    """The site table of a registered architecture (spec.ModelDims.architecture): its ``Architecture.points``."""
    return get_architecture(architecture).points


def tap_points_of(architecture: str) -> tuple[str, ...]:
    return tuple(p for p in points_of(architecture) if p not in BLOCK_IO)


# Points the harness computes beside the hooks (harness.runner.forwards): not taps, chosen by their own options.
DERIVED_POINTS: dict[str, str] = {
    "block.isolated": "mixer output of the block run on the reference's block input (--isolated) [batch, seqlen, d_model]",
}
ISOLATED = "block.isolated"
BLOCK_IO = ("block.in", "block.out", "block.residual")
TAP_POINTS = tuple(p for p in POINTS if p not in BLOCK_IO)
# Points in the residual-stream basis: stored in the checkpoint's original basis unless --basis rotated.
RESIDUAL_BASIS = BLOCK_IO

_NAME_RE = re.compile(r"^L(\d+)\.(.+)$")
# sort order over every table: the Mamba-1 sites, then Mamba-2's own before had.out (each table in data-flow order)
_ORDER = list(POINTS)
_ORDER[_ORDER.index("had.out"):_ORDER.index("had.out")] = [p for p in MAMBA2_POINTS if p not in POINTS]
_ORDER[_AFTER_XPROJ:_AFTER_XPROJ] = list(MIXER_NORM_POINTS)
_ORDER[_ORDER.index("block.out"):_ORDER.index("block.out")] = [p for p in HYBRID_POINTS if p not in _ORDER]


class TapError(ValueError):
    """An unknown tap or layer; the message lists the valid ones."""


# one --layers item: all, a block index, a negative index from the end (-1 the last), a range A-B
LAYER_SPEC_RE = re.compile(r"^(all|-?\d+|\d+-\d+)$")


def resolve_layers(spec: list, n_layer: int) -> list[int]:
    """--layers items (ints or strings: "all", "3", "-1", "0-5") -> sorted distinct block indices."""
    chosen: set[int] = set()
    valid = f"(valid: 0..{n_layer - 1}, -1..-{n_layer} from the end, all, or a range such as 0-{n_layer - 1})"
    for item in spec:
        text = str(item).strip()
        if not LAYER_SPEC_RE.match(text):
            raise TapError(f"invalid --layers item {text!r} {valid}")
        if text == "all":
            chosen |= set(range(n_layer))
            continue
        if re.match(r"^\d+-\d+$", text):
            lo, hi = (int(v) for v in text.split("-"))
            if lo > hi or hi >= n_layer:
                raise TapError(f"--layers range {text!r} does not fit: the model has {n_layer} blocks {valid}")
            chosen |= set(range(lo, hi + 1))
            continue
        i = int(text)
        if not -n_layer <= i < n_layer:
            raise TapError(f"layer {i} was requested, but the model has {n_layer} blocks {valid}")
        chosen.add(i % n_layer)
    if not chosen:
        raise TapError(f"--layers is empty {valid}")
    return sorted(chosen)


def point_name(layer: int, point: str) -> str:
    return f"L{layer}.{point}"


def hook_attr(site: str) -> str:
    """The HookPoint's attribute in a block's ``hooks`` ModuleDict (module names cannot hold dots)."""
    return site.replace(".", "_")


def module_path(layer: int, site: str) -> str:
    """The HookPoint's path in EmuBackbone, as named_modules() gives it."""
    return f"blocks.{layer}.hooks.{hook_attr(site)}"


# layer 0's block I/O under the research tool's names (its analysis snippets read mode_{m}_input, ...)
RESEARCH_TENSORS = {"block.in": "input", "block.out": "output", "block.residual": "residual"}
_KEY_RE = re.compile(r"^mode_([^_]+)_(input|output|residual)$|^mode_([^_]+)__((?:decode\.)?(?:L\d+\..+|logits)|generated_ids)$")


def tensor_name(point: str) -> str:
    """Capture point -> tensor name: layer-0 block I/O keep the research tool's names, others their point."""
    if point.startswith("L0."):
        return RESEARCH_TENSORS.get(point[3:], point)
    return point


def array_key(mode: str, tensor: str) -> str:
    """The .npz key of a mode's tensor: mode_{mode}_{input|output|residual}, else mode_{mode}__{tensor}."""
    return f"mode_{mode}_{tensor}" if tensor in RESEARCH_TENSORS.values() else f"mode_{mode}__{tensor}"


def parse_array_key(key: str) -> tuple[str, str] | None:
    """(mode, tensor) of an .npz key that array_key writes; None for any other key (metadata, ...)."""
    m = _KEY_RE.match(key)
    if not m:
        return None
    return (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))


def parse_point(name: str) -> tuple[int, str]:
    m = _NAME_RE.match(name)
    if not m or (m.group(2) not in _ORDER and m.group(2) not in DERIVED_POINTS):
        raise TapError(f"invalid capture point {name!r}; expected L<layer>.<point> with point one of: {', '.join(POINTS)} "
                       f"(Mamba-2: {', '.join(MAMBA2_POINTS)})")
    return int(m.group(1)), m.group(2)


def point_sort_key(name: str) -> tuple[int, int]:
    layer, point = parse_point(name)
    return layer, (_ORDER + list(DERIVED_POINTS)).index(point)


def select_points(layers: list[int], taps: list[str] | None, table: dict[str, str] = POINTS) -> list[str]:
    """Full point names to capture: block I/O of every layer plus the requested taps.

    taps: None/[] for none, ["all"], point names ("ssm.u", applied to every layer) or
    full names ("L1.ssm.u", which also adds layer 1). table: the model's site table (points_of).
    """
    tap_points = tuple(p for p in table if p not in BLOCK_IO)
    chosen = {point_name(layer, p) for layer in layers for p in BLOCK_IO}
    for tap in taps or []:
        if tap == "all":
            chosen |= {point_name(layer, p) for layer in layers for p in tap_points}
        elif tap in table:
            chosen |= {point_name(layer, tap) for layer in layers}
        elif _NAME_RE.match(tap):
            layer, point = parse_point(tap)
            if point not in table and point not in DERIVED_POINTS:
                raise TapError(f"tap {tap!r}: {point} is not a point of this model's blocks; valid: "
                               f"{', '.join(tap_points)}")
            chosen |= {tap} | {point_name(layer, p) for p in BLOCK_IO}
        else:
            raise TapError(f"unknown tap {tap!r}; valid: all, {', '.join(tap_points)} (or L<layer>.<point>)")
    return sorted(chosen, key=point_sort_key)


@dataclass
class Captured:
    """One captured value: real values as fp32, and the int8 codes and scale when it was quantized.

    values: (any) fp32 CPU tensor; codes: same shape int8 or None.
    """

    values: torch.Tensor
    codes: torch.Tensor | None = None
    scale: float | dict | None = None  # one scale, or a ChannelQTensor's scale_summary()
    n_clipped: int | None = None
    dtype: str | None = None  # the float dtype at the capture point (float16, float32), before the fp32 copy

    @property
    def quantized(self) -> bool:
        return self.codes is not None


def _record(x) -> Captured:
    if isinstance(x, QTensor):
        return Captured(x.dequantize().detach().cpu(), x.codes.detach().cpu().clone(), x.scale, x.n_clipped)
    if isinstance(x, ChannelQTensor):
        return Captured(x.dequantize().detach().cpu(), x.codes.detach().cpu().clone(), x.scale_summary())
    return Captured(x.detach().to("cpu", torch.float32).clone(), dtype=str(x.dtype).replace("torch.", ""))


@contextmanager
def capture(model: nn.Module, names: list[str]) -> Iterator[dict[str, Captured]]:
    """Record the values passing the named HookPoints during forwards inside the block.

    Hooks are removed on exit, also when the forward raises. A point reached
    again (a second forward) overwrites the earlier value.
    """
    wanted = set(names)
    store: dict[str, Captured] = {}
    handles = []

    def make_hook(name: str):
        def hook(_module, _inputs, output):
            store[name] = _record(output)
        return hook

    try:
        for module in model.modules():
            if isinstance(module, HookPoint):
                name = point_name(module.layer, module.point)
                if name in wanted:
                    handles.append(module.register_forward_hook(make_hook(name)))
        yield store
    finally:
        for handle in handles:
            handle.remove()


# The decode run (harness.runner.decode): every captured point once per step, the step axis second, under
# the tensor name decode.{point} (never the research names), plus each captured layer's states after the step.
DECODE_PREFIX = "decode."
STATE_POINTS: dict[str, str] = {
    "state.ssm": "SSM state after the step, dequantized [batch, steps, d_inner, d_state]",
    "state.conv": "conv window after the step (the last d_conv pre-conv x values), dequantized "
                  "[batch, steps, d_inner, d_conv]",
}
_DECODE_SKIPPED = ("ssm.state", "ssd.state", ISOLATED)  # the state after the step is state.ssm; no isolated replay


def decode_tensor(name: str) -> str:
    """A decode array's tensor name: decode.L0.block.in, decode.L0.state.ssm, decode.logits."""
    return DECODE_PREFIX + name


def decode_site(name: str) -> tuple[int, str]:
    """(layer, site) of a decode point or tensor name (decode.L0.state.ssm -> (0, "state.ssm"))."""
    m = _NAME_RE.match(name[len(DECODE_PREFIX):] if name.startswith(DECODE_PREFIX) else name)
    if not m or (m.group(2) not in _ORDER and m.group(2) not in STATE_POINTS):
        raise TapError(f"invalid decode point {name!r}; expected [decode.]L<layer>.<point> with point one of: "
                       f"{', '.join(list(POINTS) + list(STATE_POINTS))} (Mamba-2: {', '.join(MAMBA2_POINTS)})")
    return int(m.group(1)), m.group(2)


def decode_points(points: list[str]) -> list[str]:
    """The points a decode step captures, in capture order: the prefill's hooked points but ssm.state and the
    isolated replay, then each captured layer's state.ssm and state.conv after its block's points."""
    out: list[str] = []
    for layer in sorted({parse_point(p)[0] for p in points}):
        out += [p for p in points if parse_point(p)[0] == layer and parse_point(p)[1] not in _DECODE_SKIPPED]
        out += [point_name(layer, s) for s in STATE_POINTS]
    return out
