"""Analyses that run the model more than once: every sample, isolated layers, end to end, sensitivity.

For one mode, ``run_mode`` builds the emulated backbone once and, for each sample (one
forward of batch 1 each, so a sample's arrays do not depend on the others):

* captures the chosen points (``harness.emulation.capture``);
* with ``isolated``: runs each captured block again on the *reference's* input to that
  block (``L{i}.block.in`` of the reference, in the original basis; rotated into the mode's
  basis when the mode rotates) and stores the mixer output as ``L{i}.block.isolated``;
* with ``end_to_end``: continues through every block, the final norm and lm_head
  (``Head``), giving float32 logits (batch, seq, vocab).

``sensitivity`` runs the reference model with a single block replaced by the mode's.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from torch import nn

from .backbone import build_backbone
from ..emulation.capture import ISOLATED, RESIDUAL_BASIS, capture, parse_point, point_name
from ..runtime.memory import release_freed
from ..metrics.errors import tensor_stats
from ..metrics.q2groups import XGroupSums
from ..metrics.segments import SegmentSums
from ..modes import ModeRecipe, Rotate
from ..emulation.modules import EmuBackbone, EmuMambaBlock
from ..kernels.hadamard import hadamard_transform
from .head import Head, build_head, keep_only
from .sharedops import SharedOps
from ..spec import LayerScales
from ..store.format import tensor_name
from .weightbank import WeightBank

__all__ = ["ISOLATED", "RefInputs", "convert", "to_device", "Head", "build_head", "Forward", "ModeRun", "run_mode",
           "per_sample_of", "keep_only", "basis_of", "sensitivity_kl", "stack", "layer_arrays"]

_BASIS_POINTS = RESIDUAL_BASIS + (ISOLATED, "norm.out", "out_proj.out", "had.out")


def basis_of(recipe: ModeRecipe, site: str, basis: str) -> str | None:
    """The basis a stored tensor is in (None for points the rotation does not touch)."""
    if site not in _BASIS_POINTS:
        return None
    if recipe.rotate == Rotate.NO:
        return "original"
    return basis if site in RESIDUAL_BASIS + (ISOLATED,) else "rotated"


def stack(per_sample: list[np.ndarray]) -> np.ndarray:
    """One sample: the array itself (research layout); several: a leading sample axis."""
    return per_sample[0] if len(per_sample) == 1 else np.stack(per_sample)


@dataclass
class ModeRun:
    arrays: dict[str, np.ndarray] = field(default_factory=dict)        # tensor -> array (sample axis when N > 1)
    tensors: dict[str, dict] = field(default_factory=dict)             # tensor -> stats entry
    per_sample: dict[str, list[np.ndarray]] = field(default_factory=dict)
    logits: list[np.ndarray] = field(default_factory=list)             # per sample (1, seq, vocab) fp32
    block_inputs: list[dict[int, torch.Tensor]] = field(default_factory=list)  # per sample, own basis
    residuals: list[torch.Tensor] = field(default_factory=list)  # per sample, while the blocks run
    x_groups: dict[int, XGroupSums] = field(default_factory=dict)  # layer -> Quamba2's x group sums (q2 modes)
    segments: dict[int, SegmentSums] = field(default_factory=dict)  # layer -> the SE modes' segment sums
    states: list | None = None  # with keep_states: each block's BlockState after the prefill (one sample)
    final_residual: torch.Tensor | None = None  # with keep_states: the residual after the last block built


def _to_mode_basis(x: torch.Tensor, rotate: bool) -> torch.Tensor:
    return hadamard_transform(x).to(torch.float32) if rotate else x


def _to_original(x: torch.Tensor, rotate: bool) -> torch.Tensor:
    return hadamard_transform(x, transpose=True).to(torch.float32) if rotate else x


def convert(x: torch.Tensor, from_rotated: bool, to_rotated: bool) -> torch.Tensor:
    """A residual-stream tensor from one basis to the other (unchanged, bit for bit, when they agree)."""
    return x if from_rotated == to_rotated else _to_mode_basis(_to_original(x, from_rotated), to_rotated)


@dataclass
class RefInputs:
    """The reference's block inputs in its own basis (rotated or not): per sample, layer -> (1, seq, d_model)."""

    rotated: bool
    by_sample: list[dict[int, torch.Tensor]]


def isolated_out(block: EmuMambaBlock, ref_in: torch.Tensor, ref_rotated: bool, rotate: bool) -> torch.Tensor:
    """The block's mixer output (in the mode's basis) on the reference's input (in the reference's basis)."""
    with torch.no_grad():
        out, _ = block(convert(ref_in, ref_rotated, rotate))
    return out


def on_device(device: str):
    """torch.device(device) as the default for new tensors; nothing on the CPU (the mode intercepts every
    torch call: about 40,000 intercepted calls for eight layer-0 modes, measured)."""
    return contextlib.nullcontext() if device == "cpu" else torch.device(device)


def to_device(module: nn.Module, device: str) -> nn.Module:
    """Move every tensor an emulated module holds to `device`, in place: its attributes, and the tensors inside
    the dataclasses (QTensor codes, a W4 weight, Quamba2's SSD parameters), tuples, lists and dicts they hold.

    The weight bank stays on the CPU; the embedding is looked up there and its rows moved.
    """
    if device == "cpu":
        return module
    for m in module.modules():
        for name, value in list(vars(m).items()):
            if not name.startswith("_"):
                moved = _moved(value, device)
                if moved is not value:
                    setattr(m, name, moved)
        if isinstance(m, EmuBackbone):
            m.embed = lambda ids, embed=m.embed: _on_cpu(embed, ids.cpu()).to(device)
    return module


def _moved(value, device: str, depth: int = 0):
    """`value` with every tensor it holds on `device`: the same object where it holds none (a module's children
    move with ``module.modules()``)."""
    if isinstance(value, torch.Tensor):
        return value if value.is_meta else value.to(device)  # meta: a placeholder without data (q2.params' fp16)
    if depth > 4 or isinstance(value, (nn.Module, type)):
        return value
    if dataclasses.is_dataclass(value):
        changes = {f.name: _moved(getattr(value, f.name), device, depth + 1) for f in dataclasses.fields(value) if f.init}
        changed = {k: v for k, v in changes.items() if v is not getattr(value, k)}
        return dataclasses.replace(value, **changed) if changed else value
    if isinstance(value, (tuple, list)):
        items = [_moved(v, device, depth + 1) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        moved = {k: _moved(v, device, depth + 1) for k, v in value.items()}
        return moved if any(moved[k] is not value[k] for k in value) else value
    return value


def _on_cpu(fn, *args):
    """fn(*args) of CPU tensors, also inside ``on_device``: the constants fn makes (the Hadamard signs) are made on
    the CPU beside them (the embedding's rows beside the weight bank, a captured value after its copy back)."""
    with torch.device("cpu"):
        return fn(*args)


@dataclass(frozen=True)
class Forward:
    """One mode's forward over the samples: what to build, what to capture, where to run.

    samples: each (1, seq_len) int64; points: capture points in capture order; depth: the deepest block
    built (end_to_end builds them all and the head); keep_inputs: layers whose block inputs the result
    keeps (the reference's, for the isolated replay and the sensitivity study of the other modes).
    """

    recipe: ModeRecipe
    scales: list[LayerScales] | None
    samples: list[torch.Tensor]
    points: list[str]
    depth: int
    basis: str = "original"
    end_to_end: bool = False
    keep_inputs: tuple[int, ...] = ()
    device: str = "cpu"
    head_scale: float | None = None  # lm_head=quantized: the lm_head:input scale (recipes.quamba.q2.head_scale)


def run_mode(fwd: Forward, bank: WeightBank, ref_inputs: RefInputs | None = None, on_layer=None,
             shared: SharedOps | None = None, *, step: Callable[[], None] | None = None, raw=None,
             keep_states: bool = False) -> ModeRun:
    """Run one mode on every sample; the points L{i}.block.isolated in `fwd.points` are replayed on
    ref_inputs, or on the mode's own block inputs when ref_inputs is None (the reference itself).
    The result's ``block_inputs`` are the mode's own inputs of the isolated layers and `fwd.keep_inputs`
    (its basis): the RefInputs of the other modes.

    The blocks run one at a time over every sample, so each block's points are complete (every sample)
    when it finishes: with ``on_layer(arrays, tensors)`` they are handed over block by block and not
    kept (memory then holds one block's activations); without, they are collected in the result.
    device "cuda": the modules' tensors move there and every op runs under torch.device("cuda");
    arrays come back to the CPU (untested: docs/analysis.md "Device").
    shared: the run's ops shared across modes (harness.runner.sharedops); None computes every op.
    step: called when a block has run on every sample (progress).
    raw: instead of on_layer, ``raw(per_sample, codes, meta)`` per block, before stacking (``layer_arrays``
    stacks them): a unit of one sample in another process (harness.runner.units) hands these back.
    keep_states: the blocks run their ``prefill`` (the same computation) and the result's ``states`` holds
    each block's state for the first decode step, ``final_residual`` the residual after the last block
    (--decode, --generate: one sample), so no second prefill over the prompt is needed.
    """
    recipe, device = fwd.recipe, fwd.device
    model = to_device(build_backbone(recipe, bank, fwd.scales, bank.dims.n_layer - 1 if fwd.end_to_end else fwd.depth),
                      device)
    for block in model.blocks:
        block.shared = shared
    head = to_device(build_head(recipe, bank, fwd.head_scale), device) if fwd.end_to_end else None
    bank.drop_pages()  # the checkpoint pages the preparation read (a float mode's weights fault in again)
    run = ModeRun()

    def collect(arrays: dict[str, np.ndarray], tensors: dict[str, dict]) -> None:
        run.arrays.update(arrays)
        run.tensors.update(tensors)
        for name, arr in arrays.items():
            run.per_sample[name] = per_sample_of(arr, len(fwd.samples))

    with on_device(device):
        _run_blocks(fwd, model, ref_inputs, run, on_layer or collect, step=step, raw=raw, keep_states=keep_states)
        if head is not None:
            release_freed(0)  # the blocks' freed heap leaves before the logits and their metrics (the run's peak)
            run.logits = [head(residual).to(torch.float32).cpu().numpy() for residual in run.residuals]
    if keep_states:
        run.final_residual = run.residuals[0]
    run.residuals = []
    return run


def per_sample_of(arr: np.ndarray, n: int) -> list[np.ndarray]:
    """The per-sample arrays of a stored array (the inverse of ``stack``)."""
    return [arr] if n == 1 else list(arr)


def _run_blocks(fwd: Forward, model: EmuBackbone, ref_inputs: RefInputs | None, run: ModeRun, deliver, *,
                step: Callable[[], None] | None = None, raw=None, keep_states: bool = False) -> None:
    recipe, samples, points, basis, device = fwd.recipe, fwd.samples, fwd.points, fwd.basis, fwd.device
    rotate = recipe.rotate == Rotate.YES
    iso_layers = {parse_point(p)[0] for p in points if parse_point(p)[1] == ISOLATED}
    hooked = [p for p in points if parse_point(p)[1] != ISOLATED]
    own = {point_name(i, "block.in") for i in iso_layers | set(fwd.keep_inputs)} if ref_inputs is None else set()
    if own:
        run.block_inputs = [{} for _ in samples]
    run.residuals = [model.embed(ids.to(device)) for ids in samples]
    if keep_states:
        if len(samples) != 1:
            raise ValueError(f"keep_states needs one sample, got {len(samples)}")
        run.states = []
    for layer, block in enumerate(model.blocks):
        layer_hooked = [p for p in hooked if parse_point(p)[0] == layer]  # in the order of `points`
        wanted = layer_hooked + sorted(p for p in own if parse_point(p)[0] == layer and p not in layer_hooked)
        per_sample: dict[str, list[np.ndarray]] = {}
        codes: dict[str, list] = {}
        meta: dict[str, tuple] = {}
        sums = _x_group_sums(block) if layer_hooked else None
        for k in range(len(samples)):
            block_in = run.residuals[k]
            with capture(model, wanted) as captured, _probing(block, sums):
                if keep_states:  # forward's computation, plus the state it hands to the first step
                    mixed, run.residuals[k], state = block.prefill(block_in)
                    run.states.append(state)
                else:
                    mixed, run.residuals[k] = block(block_in)
            if layer_hooked and getattr(block, "segments", None) is not None:  # metrics.segments
                tap, names, counts, sq_err = block.segments
                run.segments.setdefault(layer, SegmentSums(tap, names)).add(counts, sq_err)
            for point in layer_hooked:
                if point not in captured:
                    continue  # a site the recipe does not have (had.out without rotation)
                cap = captured[point]
                site = parse_point(point)[1]
                values = cap.values
                if rotate and basis == "original" and site in RESIDUAL_BASIS:
                    values = _original_basis(block.shared, layer, site, values)
                name = tensor_name(point)
                per_sample.setdefault(name, []).append(values.numpy())
                codes.setdefault(name, []).append(None if cap.codes is None else cap.codes.numpy())
                meta[name] = (point, site, cap.scale, cap.n_clipped, cap.dtype)
            if layer in iso_layers:
                name = point_name(layer, ISOLATED)
                # on an input equal to the mode's own (the reference itself; layer 0 where the embedding is
                # shared) the replay is the forward just run: its output is taken, not computed again
                ref_in = None if ref_inputs is None else convert(ref_inputs.by_sample[k][layer].to(device),
                                                                 ref_inputs.rotated, rotate)
                same = ref_in is None or torch.equal(ref_in, block_in)
                out = (mixed if same else isolated_out(block, ref_in, rotate, rotate)).cpu()
                out = _to_original(out, rotate) if basis == "original" else out
                per_sample.setdefault(name, []).append(out.numpy())
                codes.setdefault(name, []).append(None)
                meta[name] = (name, ISOLATED, None, None, "float32")
            if point_name(layer, "block.in") in own:
                run.block_inputs[k][layer] = captured[point_name(layer, "block.in")].values
        if sums is not None:
            run.x_groups[layer] = sums
        if per_sample and raw is not None:
            raw(per_sample, codes, meta)
        elif per_sample:
            deliver(*layer_arrays(recipe, basis, per_sample, codes, meta))
            del per_sample, codes
            release_freed()  # the block's activations, gone to the file, leave the process too
        if step is not None:
            step()


def _x_group_sums(block) -> XGroupSums | None:
    """Quamba2's x group sums for a block that quantizes x by groups (it has ``x_groups``), else None."""
    groups = getattr(block, "x_groups", None)
    return None if groups is None else XGroupSums(**groups())


@contextlib.contextmanager
def _probing(block, sums: XGroupSums | None):
    """The block hands its pre-quantization x and codes to `sums` during the forward (not the isolated replay)."""
    if sums is None:
        yield
        return
    block.x_probe = lambda values, codes: sums.add(values.cpu().numpy(), codes.cpu().numpy())
    try:
        yield
    finally:
        del block.x_probe


def _original_basis(shared: SharedOps | None, layer: int, site: str, values: torch.Tensor) -> torch.Tensor:
    """Had^T of a captured residual-stream value (exact, then fp32); with `shared`, a value another mode
    had bit for bit takes its result (a copy: each mode's arrays are its own)."""
    def undo(v: torch.Tensor) -> torch.Tensor:
        return hadamard_transform(v, transpose=True).to(torch.float32)
    return undo(values) if shared is None else shared.call(layer, f"original_basis.{site}", None, undo, values).clone()


def layer_arrays(recipe, basis, per_sample, codes, meta) -> tuple[dict[str, np.ndarray], dict[str, dict]]:
    arrays, tensors = {}, {}
    for name, values in per_sample.items():
        point, site, scale, n_clipped, dtype = meta[name]
        arrays[name] = stack(values)
        c = codes[name]
        clipped = None if n_clipped is None or len(values) > 1 else n_clipped
        tensors[name] = {"point": point, "basis": basis_of(recipe, site, basis),
                         **tensor_stats(arrays[name], None if c[0] is None else stack(c), scale, clipped, dtype)}
    return arrays, tensors


@torch.no_grad()
def sensitivity_kl(mode: Forward, ref: Forward, bank: WeightBank, ref_inputs: RefInputs,
                   ref_logits: list[np.ndarray], layers: list[int], kl, *,
                   step: Callable[[], None] | None = None) -> dict[int, list[float]]:
    """layer -> per-sample KL(reference || model with only that block in `mode.recipe`).

    The reference's residual entering block i (its captured block input) plus the mode's block i
    output on it (converted to the reference's basis), then the reference's blocks i+1.. and head.
    The samples and the device are `mode`'s.
    """
    samples, device = mode.samples, mode.device
    rotate, ref_rotate = mode.recipe.rotate == Rotate.YES, ref_inputs.rotated
    mode_model = to_device(build_backbone(mode.recipe, bank, mode.scales, max(layers)), device)
    ref_model = to_device(build_backbone(ref.recipe, bank, ref.scales, bank.dims.n_layer - 1), device)
    ref_head = to_device(build_head(ref.recipe, bank, ref.head_scale), device)
    out: dict[int, list[float]] = {}
    with on_device(device):
        for layer in layers:
            out[layer] = []
            for k in range(len(samples)):
                ref_in = ref_inputs.by_sample[k][layer].to(device)
                mixed = isolated_out(mode_model.blocks[layer], ref_in, ref_inputs.rotated, rotate)
                residual = ref_in + convert(mixed, rotate, ref_rotate)  # in the reference's own basis
                for block in ref_model.blocks[layer + 1:]:
                    _, residual = block(residual)
                out[layer].append(kl(ref_logits[k], ref_head(residual).to(torch.float32).cpu().numpy()))
                if step is not None:
                    step()  # one forward of one sample (progress)
    return out
