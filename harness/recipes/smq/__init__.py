"""SmQ-SSM: SmoothQuant for Mamba-1 (the Quamba paper's baseline; docs/field-recipes.md "SmQ-SSM"), modes ``smq-ssm``
(alpha 0.5, static per-tensor W8A8 after smoothing) and ``smq-ssm+transform`` (the smoothing alone: equal to fp32
within float rounding). Option ``alpha`` (0 < alpha < 1; a modes file: {"base": "smq-ssm", "options": {"alpha":
0.6}}). Importing the package registers the family."""
from __future__ import annotations

import math

import torch

from ...emulation.modules import EmuBackbone
from ...modes import ModeRecipe
from ...runner.statcache import cached_statistics
from ..registry import Recipe, register_recipe
from .blocks import build, observe_channels, observe_scales, smoothing_vectors, static_scale

__all__ = ["SmqSsm", "calibrate_smq", "alpha_of"]

_KNOBS = dict(weights="fp32", rotate="no", norm_out="fp", in_proj_out="fp", conv_in="static", conv_out="fp32",
              ssm_u="fp32", ssm_impl="reference", had_out="fp", act_dtype="fp32", prep="exact")
_OPTIONS = ("alpha",)


def alpha_of(mode: ModeRecipe) -> float:
    return float(mode.option("alpha", "0.5"))


def _forward_all(model, windows, settings) -> None:
    for batch in windows.split(settings.batch_size):
        model(batch)


def calibrate_smq(mode: ModeRecipe, bank, windows, settings, depth: int, prefix_hashes, cache_dir):
    """Pass 1 (per-channel max |x| of the fp32 model) -> smoothing vectors; pass 2 (the smoothed model) -> the
    static per-tensor scales of the nine points (the notes §2: two passes over the same windows)."""
    alpha = alpha_of(mode)

    def compute():
        embed = lambda ids: bank.embed(ids, False, torch.float32, "exact", "fp32")  # noqa: E731
        blocks, channels = observe_channels(mode, bank, depth)
        _forward_all(EmuBackbone(embed, blocks), windows, settings)
        vectors = [smoothing_vectors(bank, i, {p: o.amax for p, o in layer.items()}, alpha)
                   for i, layer in enumerate(channels)]
        blocks, observers = observe_scales(mode, bank, depth, vectors)
        _forward_all(EmuBackbone(embed, blocks), windows, settings)
        return [{**{p: static_scale(o.amax) for p, o in obs.items()}, **s} for obs, s in zip(observers, vectors)]
    return cached_statistics("smq", "smq-ssm", windows, settings, depth, prefix_hashes, cache_dir, compute=compute,
                             extra={"alpha": alpha})


class SmqSsm(Recipe):
    name = "smq"
    title = "SmQ-SSM: SmoothQuant for Mamba-1 (alpha 0.5, four points), static per-tensor W8A8 (Quamba1 fake path)"

    def architectures(self, mode: ModeRecipe) -> tuple[str, ...]:
        return ("mamba1",)

    def architecture_problem(self, mode: ModeRecipe, architecture: str) -> str | None:
        if architecture == "mamba1":
            return None
        return ("SmQ-SSM is defined for Mamba-1 blocks only (Quamba1's simulated path, enyac-group/Quamba@624361b "
                "quamba/fake_quant); on Mamba-2 run naive-static, naive-dynamic or q2-w8a8")

    def mode_problem(self, mode: ModeRecipe) -> str | None:
        bad = sorted(set(dict(mode.options)) - set(_OPTIONS) - {"quantize"})
        if bad:
            return f"unknown option(s) {', '.join(bad)}; valid: alpha (0 < alpha < 1)"
        try:
            alpha = alpha_of(mode)
        except ValueError:
            return f"alpha={mode.option('alpha', '')!r} is not a number; valid: 0 < alpha < 1 (SmoothQuant's 0.5)"
        if not (math.isfinite(alpha) and 0.0 < alpha < 1.0):
            return f"alpha={alpha} is outside (0, 1); valid: 0 < alpha < 1 (SmoothQuant's 0.5)"
        return None

    def calibration_key(self, mode: ModeRecipe) -> str | None:
        return f"smq-ssm@alpha={alpha_of(mode)}"

    def calibrate(self, key, bank, windows, settings, depth, prefix_hashes, cache_dir, *, progress=None):
        alpha = key.split("=", 1)[1]
        mode = ModeRecipe("smq-calibration", "SmQ-SSM calibration", **_KNOBS, family="smq", options={"alpha": alpha})
        return calibrate_smq(mode, bank, windows, settings, depth, prefix_hashes, cache_dir)

    def build_blocks(self, mode, bank, scales, depth, calibration=False):
        if scales is None:
            raise ValueError(f"mode {mode.name!r} needs its smoothing vectors (calibration {self.calibration_key(mode)})")
        return build(mode, bank, scales, depth, quantize=mode.option("quantize", "yes") == "yes")


SmqSsm.modes = (
    ModeRecipe("smq-ssm", "SmQ-SSM: SmoothQuant (alpha 0.5) + static per-tensor W8A8", **_KNOBS, family="smq",
               options={"alpha": "0.5"}),
    ModeRecipe("smq-ssm+transform", "SmQ-SSM's smoothing alone (no quantization): fp32 within rounding", **_KNOBS,
               family="smq", options={"alpha": "0.5", "quantize": "no"}),
)
register_recipe(SmqSsm())
