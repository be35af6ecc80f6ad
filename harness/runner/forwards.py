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

import weakref
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import torch
from torch import nn

from ..emulation.build import act_dtype, build_backbone
from ..emulation.capture import ISOLATED, RESIDUAL_BASIS, capture, parse_point, point_name
from ..runtime.memory import release_freed
from ..metrics.errors import tensor_stats
from ..metrics.q2groups import XGroupSums
from ..modes import LmHead, ModeRecipe, Rotate, Weights
from ..emulation.modules import EmuBackbone, EmuMambaBlock, EmuRMSNorm
from ..emulation.ops.hadamard import hadamard_transform
from ..emulation.ops.linear import float_linear, int8_gemm
from ..emulation.ops.quant import dequantize, round_to_dtype, to_output
from ..emulation.q2_head import w8a8_lm_head
from .headprep import rotated_head, round_rows_
from .sharedops import SharedOps
from ..spec import FLOAT_DTYPES, FloatOut, LayerScales, QTensor, QuantOut, Rounding
from ..store.format import tensor_name
from .weightbank import WeightBank, lm_head_weight

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


class Head(nn.Module):
    """Final RMSNorm and lm_head: residual (batch, seq, d_model) fp32 -> logits (batch, seq, vocab) fp32.

    Float recipes (the Quamba1 recipe keeps both in floating point): the norm in fp32 arithmetic
    with its weight, lm_head in the recipe's weight dtype (fp16 for int8 weights), output rounded
    to act_dtype. Rotated recipes fold norm_f's weight into lm_head and rotate it (as the blocks,
    modelutils_mamba.py:64-70). A Quamba checkpoint's W8A8B16O16Linear lm_head: norm_f output
    quantized at its output scale (RNE), int8 GEMM, times the stored fp32 alpha, fp16 output.
    """

    def __init__(self, norm: EmuRMSNorm, weight: torch.Tensor | QTensor, out: FloatOut, alpha: float | None = None):
        super().__init__()
        self.norm, self.weight, self.out, self.alpha = norm, weight, out, alpha

    @torch.no_grad()
    def forward(self, residual: torch.Tensor) -> torch.Tensor:
        x = self.norm(residual)
        if isinstance(self.weight, QTensor):
            acc = int8_gemm(x.codes, self.weight.codes).to(torch.float32)
            return to_output(torch.tensor(self.alpha, dtype=torch.float32) * acc, self.out)
        if isinstance(self.out, FloatOut):  # float_linear's rounding, in place and by rows: no copies of the logits
            return round_rows_(nn.functional.linear(dequantize(x), dequantize(self.weight)), self.out.dtype)
        return float_linear(x, self.weight, self.out)


# bank -> (dtype, rotate, prep) -> (norm weight or None, lm_head weight): prepared once per run, shared between modes
_HEADS: "weakref.WeakKeyDictionary[WeightBank, dict]" = weakref.WeakKeyDictionary()


def _float_head(bank: WeightBank, dtype: torch.dtype, rotate: bool, prep: str) -> tuple[torch.Tensor | None, torch.Tensor]:
    cache = _HEADS.setdefault(bank, {})
    if (dtype, rotate, prep) not in cache and prep == "quamba" and rotate:  # Quamba's own fp16 head
        cache[(dtype, rotate, prep)] = (None, lm_head_weight(bank.ckpt))
    if (dtype, rotate, prep) not in cache:
        ckpt = bank.ckpt
        w = ckpt.tensor("lm_head.weight") if ckpt.has("lm_head.weight") else ckpt.embedding()  # tied: the embedding
        norm_w = round_to_dtype(ckpt.tensor("backbone.norm_f.weight").to(torch.float32), dtype)
        if rotate:  # rounded to dtype block by block there: no unrotated copy of the head
            norm_w, w = None, rotated_head(w, norm_w, dtype)
        else:
            w = round_to_dtype(w.to(torch.float32), dtype)
        cache[(dtype, rotate, prep)] = (norm_w, w)
    release_freed()
    return cache[(dtype, rotate, prep)]


def _head_key(recipe: ModeRecipe) -> tuple[torch.dtype, bool, str]:
    return FLOAT_DTYPES["fp16" if recipe.weights in (Weights.INT8, Weights.INT4) else recipe.weights], recipe.rotate == Rotate.YES, recipe.prep


def keep_only(bank: WeightBank, recipes: list[ModeRecipe]) -> None:
    """Release the prepared blocks and heads that none of `recipes` (the modes still to run) uses.

    Peak memory then holds the weight variants of the modes to come, not of every mode run so far.
    """
    bank.keep_only({(r.weights, r.rotate == Rotate.YES, r.prep) for r in recipes})
    heads, needed = _HEADS.get(bank, {}), {_head_key(r) for r in recipes}
    for key in [k for k in heads if k not in needed]:
        del heads[key]


def build_head(recipe: ModeRecipe, bank: WeightBank, head_scale: float | None = None) -> Head:
    dims, rotate = bank.dims, recipe.rotate == Rotate.YES
    act = FloatOut(act_dtype(recipe))
    if recipe.lm_head == LmHead.QUANTIZED:  # W8A8B16O16Linear of the mode's own fp16 head (emulation.q2_head)
        fp16_head = build_head(replace(recipe, lm_head=LmHead.FP16), bank)
        if isinstance(fp16_head.weight, QTensor):  # a Quamba2 checkpoint exported with --quantize_lm_head: its own
            return fp16_head
        if head_scale is None:
            raise ValueError(f"mode {recipe.name!r}: lm_head=quantized needs the lm_head:input scale, which the "
                             f"calibration of the float model observes (a checkpoint's stored scales hold none)")
        weight, alpha = w8a8_lm_head(fp16_head.weight, head_scale)
        return Head(EmuRMSNorm(None, dims.norm_eps, QuantOut(head_scale, Rounding.HALF_EVEN)), weight,
                    FloatOut(torch.float16), alpha)
    if bank._uses_given(recipe.weights, rotate, recipe.prep):  # the Quamba checkpoint's own head
        weight, s_in, alpha = bank.given.lm_head()
        if isinstance(weight, QTensor):
            # QRMSNorm: rint (half even) at the output scale (qNorm.py:38-39, spec notes §2.6 step 1)
            return Head(EmuRMSNorm(None, dims.norm_eps, QuantOut(s_in, Rounding.HALF_EVEN)), weight,
                        FloatOut(torch.float16), alpha)
        return Head(EmuRMSNorm(None, dims.norm_eps, act), weight, act)
    norm_w, w = _float_head(bank, *_head_key(recipe))
    return Head(EmuRMSNorm(norm_w, dims.norm_eps, act), w, act)


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
    """Move every tensor an emulated module holds (plain attributes, QTensor codes) to `device`, in place.

    The weight bank stays on the CPU; the embedding is looked up there and its rows moved.
    """
    if device == "cpu":
        return module
    for m in module.modules():
        for name, value in list(vars(m).items()):
            if isinstance(value, torch.Tensor):
                setattr(m, name, value.to(device))
            elif isinstance(value, QTensor):
                setattr(m, name, QTensor(value.codes.to(device), value.scale, value.n_clipped))
        if isinstance(m, EmuBackbone):
            m.embed = lambda ids, embed=m.embed: embed(ids.cpu()).to(device)
    return module


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
    head_scale: float | None = None  # lm_head=quantized: the lm_head:input scale (runner.q2_head_scale)


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
    run = ModeRun()

    def collect(arrays: dict[str, np.ndarray], tensors: dict[str, dict]) -> None:
        run.arrays.update(arrays)
        run.tensors.update(tensors)
        for name, arr in arrays.items():
            run.per_sample[name] = per_sample_of(arr, len(fwd.samples))

    with on_device(device):
        _run_blocks(fwd, model, ref_inputs, run, on_layer or collect, step=step, raw=raw, keep_states=keep_states)
        if head is not None:
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
