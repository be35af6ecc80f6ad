"""One model opened for evaluation: its modes built as whole emulated models (embedding, every block, final norm and
lm_head), each calibration run once per model and settings (and kept in the calibration cache on disk).

``EvalSession`` opens the model (a float model, or a Quamba / Quamba2 checkpoint with its float model), resolves a
mode against the model's architecture, calibrates what the mode needs and hands back an ``EmulatedLM``: token ids in,
fp32 logits out, and greedy generation through the blocks' recurrent step. Nothing here imports lm-eval
(``harness.lmeval.model`` adapts it to lm-eval's ``LM`` interface).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..checkpoints.text import DEFAULT_CALIB_FILE, calibration_windows, check_token_ids
from ..modes import ModeRecipe
from ..plugins import load_all
from ..recipes.registry import recipe_for, resolve_modes
from ..runtime.guard import Progress
from ..runner.backbone import build_backbone
from ..runner.calibration import CalibrationResult, CalibrationSettings, default_cache_dir
from ..runner.config import RunError
from ..runner.forwards import on_device, to_device
from ..runner.head import build_head
from ..runner.pairing import checkpoint_calibration, needs_float, open_models

__all__ = ["SessionKey", "EvalSession", "EmulatedLM", "session_for", "pads_safely"]


@dataclass(frozen=True)
class SessionKey:
    """What decides a session's calibrations: the model, its float model, the calibration settings and text, the
    cache, the plugins and the modes file. Two lm-eval models with equal keys share one session."""

    pretrained: Path
    mamba_model_path: Path | None = None
    tokenizer: Path | None = None
    calib: CalibrationSettings = field(default_factory=CalibrationSettings)
    calib_file: Path = DEFAULT_CALIB_FILE
    cache_dir: Path | None = field(default_factory=default_cache_dir)
    plugins: tuple[str, ...] = ()
    modes_file: Path | None = None


def pads_safely(recipe: ModeRecipe) -> bool:
    """Whether sequences of different lengths may share a right-padded batch: a mode with a dynamic (per-tensor,
    data-dependent) quantizer would see the padding in its scale, so it runs its sequences one at a time."""
    return not any(str(v) == "dynamic" for v in recipe.knobs().values())


class EmulatedLM:
    """One mode's whole model: ``logits(ids)`` (batch, seq) int64 -> (batch, seq, vocab) fp32, ``greedy``."""

    def __init__(self, recipe: ModeRecipe, backbone, head, device: str = "cpu") -> None:
        self.recipe, self.device = recipe, device
        self.backbone, self.head = to_device(backbone, device), to_device(head, device)
        self.pads_safely = pads_safely(recipe)

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        with on_device(self.device):
            return self.head(self.backbone(ids.to(torch.int64))).to(torch.float32).cpu()

    @torch.no_grad()
    def greedy(self, ids: torch.Tensor, max_new: int, stop: Callable[[list[int]], bool]) -> list[int]:
        """Up to max_new greedy tokens after ids (1, L), through the recurrent step (the prefill, then one step per
        token, as harness.runner.generate); stop(tokens so far) ends it early. Ties go to the lowest id."""
        out: list[int] = []
        if max_new <= 0:
            return out
        with on_device(self.device):
            residual, states = self.backbone.prefill(ids.to(torch.int64))
            token = self.head(residual[:, -1:]).argmax(-1)
            out.append(int(token))
            while len(out) < max_new and not stop(out):
                residual, states = self.backbone.step(token, states)
                token = self.head(residual).argmax(-1)
                out.append(int(token))
        return out


class EvalSession:
    """A model opened once; its modes' calibrations, run once each (``emulated`` builds a mode's model)."""

    def __init__(self, key: SessionKey, progress: Progress | None = None, emit: Callable[[str], None] = print) -> None:
        load_all(list(key.plugins))
        self.key, self.progress, self.emit = key, progress or Progress(), emit
        self.models = open_models(Path(key.pretrained), key.mamba_model_path)
        self.tokenizer = self.models.tokenizer(key.tokenizer)
        self.dims = self.models.primary.dims
        self.depth = self.dims.n_layer - 1
        self.calibs: dict[str, CalibrationResult] = {}
        self._windows: torch.Tensor | None = None
        self._prefix: list[str] | None = None

    @property
    def architecture(self) -> str:
        return self.dims.architecture

    def recipe(self, mode: str) -> ModeRecipe:
        """The mode as it runs on this model; a ModeError / RunError naming it when it cannot."""
        recipes = resolve_modes([mode], self.key.modes_file, self.architecture)
        if len(recipes) != 1:
            raise RunError(f"mode {mode!r} is a preset of {len(recipes)} modes; name one mode "
                           f"({', '.join(r.name for r in recipes)})")
        recipe = recipes[0]
        recipe.check_layers(self.dims.n_layer)
        if (problem := recipe_for(recipe).model_problem(recipe, self.dims)) is not None:
            raise RunError(f"mode {recipe.name} cannot run on {self.key.pretrained}: {problem}")
        q = self.models.quamba
        if q is not None and self.models.float_ckpt is None and needs_float(recipe, q.prep, q):
            raise RunError(f"mode {recipe.name} needs the float model, but {self.key.pretrained} is a quantized "
                           f"Quamba checkpoint: pass mamba_model_path=DIR (the float model it was made from)")
        return recipe

    def calibration_windows(self) -> torch.Tensor:
        """The calibration text's windows (read once; a DataError names a text too short or unreadable)."""
        if self._windows is None:
            s = self.key.calib
            text = calibration_windows(self.tokenizer, self.key.calib_file, s.num_samples, s.seqlen, s.seed)
            check_token_ids(text.ids, self.dims.vocab_size, self.tokenizer.path)
            self._windows = text.ids
        return self._windows

    def prepare(self, recipes: list[ModeRecipe]) -> None:
        """Every calibration `recipes` read, each once per session (and from the cache on disk when it holds it)."""
        owners = {}
        for r in recipes:
            if (k := recipe_for(r).calibration_key(r)) is not None and k not in self.calibs:
                owners.setdefault(k, recipe_for(r))
        for k, family in owners.items():
            if self.models.gives_scales(k):
                self.calibs[k] = checkpoint_calibration(self.models.quamba, self.depth)
                continue
            if self._prefix is None:
                self._prefix = self.models.primary.prefix_hashes(self.depth)
            self.calibs[k] = family.calibrate(k, self.models.bank, self.calibration_windows(), self.key.calib,
                                              self.depth, self._prefix, self.key.cache_dir, progress=self.progress)
            info = self.calibs[k].info
            self.emit(f"calibration (prep={k}): {info.get('source', 'done')} ({self.key.calib.num_samples} samples "
                      f"x {self.key.calib.seqlen} tokens, {info.get('seconds', '?')} s)")
        if self.models.needs_calibration(recipes):
            windows = self.calibration_windows()
            for family in dict.fromkeys(recipe_for(r) for r in recipes):
                family.after_calibration(self.calibs, recipes, self.models.bank, windows, self.key.calib,
                                         self.key.cache_dir, self.progress)

    def emulated(self, mode: str | ModeRecipe, device: str = "cpu") -> EmulatedLM:
        recipe = self.recipe(mode) if isinstance(mode, str) else mode
        self.prepare([recipe])
        key = recipe_for(recipe).calibration_key(recipe)
        calib = self.calibs.get(key) if key is not None else None
        scales = calib.scales if calib is not None else None
        head_scale = calib.info.get("lm_head_input_scale") if calib is not None else None
        backbone = build_backbone(recipe, self.models.bank, scales, self.depth)
        return EmulatedLM(recipe, backbone, build_head(recipe, self.models.bank, head_scale), device)


_SESSIONS: dict[SessionKey, EvalSession] = {}


def session_for(key: SessionKey) -> EvalSession:
    """The session of `key`, opened on first use and shared afterwards (lm-eval builds one model per mode)."""
    if key not in _SESSIONS:
        _SESSIONS[key] = EvalSession(key)
    return _SESSIONS[key]
