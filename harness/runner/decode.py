"""Teacher-forced decode steps of one mode (--decode N): the prefill over the prompt, then N one-token steps.

Every mode sees the same inputs: the prefill over the first L tokens of the sample, then steps fed the
sample's next N tokens, each through the mode's own step path (``EmuMambaBlock.step``; docs/decode.md).
Each captured point is recorded once per step and stored with the step axis second under
``decode.{point}`` (``emulation.capture.decode_tensor``), with each captured layer's states after the
step (``decode.L{i}.state.ssm`` / ``state.conv``, dequantized) and, end to end, ``decode.logits``
[1, N, vocab] (step k = position L + k). The arrays go to the same Collector and pair as the prefill's.

Per mode the stats gain a ``decode`` entry: every metric per step against the reference for every decode
tensor, KL and top-1 agreement per step, and the prefill/decode consistency: the step's block output
against the same mode's prefill over all L + N tokens at position L + k.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .backbone import build_backbone
from ..emulation.capture import RESIDUAL_BASIS, STATE_POINTS, capture, decode_points, decode_site, decode_tensor, \
    point_name
from ..emulation.state import BlockState
from ..metrics.errors import error_metrics, tensor_stats
from ..metrics.logits import kl_divergence, top1_agreement
from ..modes import Rotate
from ..spec import QTensor
from ..kernels.hadamard import hadamard_transform
from .context import RunContext
from .forwards import Forward, basis_of, build_head
from .weightbank import WeightBank

__all__ = ["DecodePlan", "DecodeResult", "run_decode", "per_step_rows", "decode_mode", "STEP_METRICS"]

# the metrics kept per step (every metric over all steps is the Collector's comparison of the whole array)
STEP_METRICS = ("rel_l2", "sqnr_db", "max_abs", "cosine", "mse")


def _to_original(x: torch.Tensor, rotated: bool) -> torch.Tensor:
    """A residual-stream value of a rotated mode back in the original basis (Had^T, exact, then fp32)."""
    return hadamard_transform(x, transpose=True).to(torch.float32) if rotated else x


@dataclass(frozen=True)
class DecodePlan:
    """ids: (1, L + N) int64, the prompt then the teacher-forced tokens; prompt_len: L."""

    ids: torch.Tensor
    prompt_len: int

    @property
    def steps(self) -> int:
        return int(self.ids.shape[1]) - self.prompt_len


@dataclass
class DecodeResult:
    arrays: dict[str, np.ndarray]
    tensors: dict[str, dict]
    consistency: dict[str, dict]


def _state_capture(layer: int, state: BlockState) -> dict[str, tuple[torch.Tensor, QTensor | None]]:
    """(values (1, 1, ...), the int8 QTensor or None) of a block's states after a step; none for a block without
    an SSM state (a hybrid's attention block: its KV cache grows each step, an MLP: no state)."""
    if getattr(state, "ssm", None) is None:
        return {}
    def one(x) -> tuple[torch.Tensor, QTensor | None]:
        q = x if isinstance(x, QTensor) else None
        return (x.dequantize() if q else x.to(torch.float32))[:, None].clone(), q
    return {point_name(layer, "state.ssm"): one(state.ssm), point_name(layer, "state.conv"): one(state.conv)}


class _Steps:
    """The per-step values of every decode point, stacked along the step axis at the end."""

    def __init__(self) -> None:
        self.values: dict[str, list[np.ndarray]] = {}
        self.codes: dict[str, list[np.ndarray | None]] = {}
        self.meta: dict[str, tuple] = {}

    def add(self, point: str, values: torch.Tensor, codes: torch.Tensor | None, scale, dtype: str | None) -> None:
        self.values.setdefault(point, []).append(values.numpy())
        self.codes.setdefault(point, []).append(None if codes is None else codes[:, None].numpy()
                                                if codes.dim() == values.dim() - 1 else codes.numpy())
        self.meta[point] = (scale, dtype)

    def arrays(self, fwd: Forward) -> tuple[dict[str, np.ndarray], dict[str, dict]]:
        arrays, tensors = {}, {}
        for point, per_step in self.values.items():
            name = decode_tensor(point)
            arr = np.concatenate(per_step, axis=1)
            codes = self.codes[point]
            scale, dtype = self.meta[point]
            site = decode_site(point)[1] if point != "logits" else None
            arrays[name] = arr
            tensors[name] = {"point": name, "basis": None if site is None else basis_of(fwd.recipe, site, fwd.basis),
                             **tensor_stats(arr, None if codes[0] is None else np.concatenate(codes, axis=1), scale,
                                            None, dtype)}
        return arrays, tensors


def run_decode(fwd: Forward, plan: DecodePlan, bank: WeightBank,
               states: list[BlockState] | None = None, step: Callable[[], None] | None = None) -> DecodeResult:
    """The prefill over plan's prompt and plan.steps teacher-forced steps of fwd's mode (CPU).

    states: every block's state after the mode's prefill over the prompt, handed over by the capture run
    (``forwards.run_mode(keep_states=True)``: the same prefill, bit for bit); None runs that prefill here.
    step: called after each decode step (the progress line)."""
    recipe = fwd.recipe
    rotate = recipe.rotate == Rotate.YES
    depth = bank.dims.n_layer - 1 if fwd.end_to_end else fwd.depth
    model = build_backbone(recipe, bank, fwd.scales, depth)
    head = build_head(recipe, bank, fwd.head_scale) if fwd.end_to_end else None
    points = decode_points(fwd.points)
    hooked = [p for p in points if decode_site(p)[1] not in STATE_POINTS]
    layers = sorted({decode_site(p)[0] for p in points})
    steps = _Steps()
    L = plan.prompt_len
    with torch.no_grad():
        full = _prefill_outputs(model, head, plan.ids, layers, rotate)
        if states is None:
            _, states = model.prefill(plan.ids[:, :L])
        with capture(model, hooked) as got:  # the hooks once for every step (each step records every point anew)
            for k in range(plan.steps):
                got.clear()
                residual, states = model.step(plan.ids[:, L + k:L + k + 1], states)
                _record_step(steps, got, hooked, rotate and fwd.basis == "original")
                for layer in layers:
                    for point, (values, q) in _state_capture(layer, states[layer]).items():
                        steps.add(point, values, None if q is None else q.codes, None if q is None else q.scale,
                                  "float32")
                if head is not None:
                    steps.add("logits", head(residual).to(torch.float32), None, None, "float32")
                if step is not None:
                    step()
    arrays, tensors = steps.arrays(fwd)
    return DecodeResult(arrays, tensors, _consistency(arrays, full, L, rotate and fwd.basis == "rotated"))


def _record_step(steps: _Steps, got: dict, hooked: list[str], to_original: bool) -> None:
    """One step's captured points into `steps` (residual-stream points of a rotated mode back in the original
    basis when to_original)."""
    for point in hooked:
        if point not in got:
            continue  # a site the recipe does not have (had.out without rotation)
        cap = got[point]
        values = cap.values
        if to_original and decode_site(point)[1] in RESIDUAL_BASIS:
            values = _to_original(values, True)
        steps.add(point, values, cap.codes, cap.scale, cap.dtype)


def _prefill_outputs(model, head, ids: torch.Tensor, layers: list[int], rotated: bool) -> dict[str, np.ndarray]:
    """The same mode's prefill over all L + N tokens: each captured layer's block output (original basis
    for a rotated mode: Had^T of it) and the logits."""
    names = [point_name(i, "block.out") for i in layers]
    with capture(model, names) as got:
        residual = model(ids)
    out = {n: _to_original(got[n].values, rotated).numpy() for n in names if n in got}
    if head is not None:
        out["logits"] = head(residual).to(torch.float32).numpy()
    return out


def _consistency(arrays: dict[str, np.ndarray], full: dict[str, np.ndarray], L: int,
                 rotated_basis: bool) -> dict[str, dict]:
    """Per captured block output (and the logits): the step's value against the prefill's at position L + k,
    per step and over all steps (rel_l2, max_abs). A --basis rotated run compares in the original basis."""
    out = {}
    for name, prefill in full.items():
        step = arrays.get(decode_tensor(name))
        if step is None:
            continue
        if rotated_basis and name != "logits":
            step = _to_original(torch.from_numpy(np.ascontiguousarray(step)), True).numpy()
        ref = prefill[:, L:]
        per = [error_metrics(ref[:, k], step[:, k]) for k in range(step.shape[1])]
        total = error_metrics(ref, step)
        out[decode_tensor(name)] = {"rel_l2": total["rel_l2"], "max_abs": total["max_abs"],
                                    "per_step": {"rel_l2": [r["rel_l2"] for r in per],
                                                 "max_abs": [r["max_abs"] for r in per]}}
    return out


def per_step_rows(ref_get: Callable[[str], np.ndarray], arrays: dict[str, np.ndarray],
                  ref_names: list[str]) -> dict[str, dict]:
    """Against the reference, for every decode tensor both have (same shape): STEP_METRICS per step, and
    for decode.logits KL and top-1 agreement per step. tensor -> metric -> [value per step]."""
    rows: dict[str, dict] = {}
    for name, arr in arrays.items():
        if name not in ref_names:
            continue
        ref = np.array(ref_get(name))  # a copy: the reference may be memory-mapped read-only
        if ref.shape != arr.shape:
            continue
        per = [error_metrics(ref[:, k], arr[:, k]) for k in range(arr.shape[1])]
        rows[name] = {m: [r[m] for r in per] for m in STEP_METRICS}
        if name == decode_tensor("logits"):
            rows[name]["kl"] = [kl_divergence(ref[:, k], arr[:, k]) for k in range(arr.shape[1])]
            rows[name]["top1_agreement"] = [top1_agreement(ref[:, k], arr[:, k]) for k in range(arr.shape[1])]
    return rows


def decode_mode(ctx: RunContext, fwd: Forward, deliver: Callable, entry: dict, ref: tuple | None,
                states: list[BlockState] | None = None) -> None:
    """Run the decode steps of one mode of the run, hand its arrays to `deliver` (the mode loop's on_layer:
    checked, compared, streamed into the pair) and record ``entry["decode"]``. ref: (get, names) of the
    reference's arrays for the per-step comparison, None for the reference itself. states: the capture
    prefill's states (``run_decode``), None to run the prefill again."""
    plan = DecodePlan(ctx.decode_ids, ctx.cfg.seq_len)
    with ctx.progress.stage(f"decoding (mode {fwd.recipe.name})", plan.steps, "steps"):
        result = run_decode(fwd, plan, ctx.bank, states, step=ctx.progress.advance)
    deliver(result.arrays, result.tensors)
    entry["decode"] = {"prompt_len": plan.prompt_len, "steps": plan.steps, "consistency": result.consistency}
    if ref is not None:
        entry["decode"]["per_step"] = per_step_rows(ref[0], result.arrays, ref[1])
