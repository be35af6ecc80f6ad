"""The naive W8A8 baselines of the field (docs/field-recipes.md "Naive W8A8"): ``naive-static`` (Quamba1's
simulated path with no flags: static per-tensor activations) and ``naive-dynamic`` (PTQ-SSM's W8A8Linear:
dynamic per-tensor), on Mamba-1, Mamba-2 and the hybrids' Mamba-2 blocks. Importing the package registers the family."""
from __future__ import annotations

import torch

from ...emulation.modules import EmuBackbone
from ...modes import ModeRecipe
from ...runner.statcache import cached_statistics
from ..registry import Recipe, register_recipe
from .blocks import build_dynamic, build_static, observe_static, static_scale

__all__ = ["Naive", "FLOAT_KNOBS", "calibrate_static"]

# the knobs of an unrotated fp32 model: the blocks these recipes wrap (their quantizers are the family's)
FLOAT_KNOBS = dict(weights="fp32", rotate="no", norm_out="fp", in_proj_out="fp", conv_in="static", conv_out="fp32",
                   ssm_u="fp32", ssm_impl="reference", had_out="fp", act_dtype="fp32", prep="exact")
_KEY = "naive-static"
_F32 = torch.float32


def calibrate_static(bank, windows, settings, depth: int, prefix_hashes, cache_dir, *, progress=None):
    """Per layer the static per-tensor scale of each point: max|x| / 127 of the fp32 model over the windows."""
    def compute():
        blocks, observers = observe_static(_MODES[0], bank, depth)
        model = EmuBackbone(lambda ids: bank.embed(ids, False, _F32, "exact", "fp32"), blocks)
        for batch in windows.split(settings.batch_size):
            model(batch)
        return [{p: static_scale(o.amax) for p, o in layer.items()} for layer in observers]
    return cached_statistics("naive", _KEY, windows, settings, depth, prefix_hashes, cache_dir, compute=compute,
                             extra={"architecture": bank.dims.architecture})


class Naive(Recipe):
    name = "naive"
    title = "naive W8A8: static (Quamba1 fake path, no flags) or dynamic (PTQ-SSM) per-tensor int8"

    def architectures(self, mode: ModeRecipe) -> tuple[str, ...]:
        return ("mamba1", "mamba2", "bamba", "nemotron_h")  # a hybrid: its Mamba-2 blocks (blocks.py)

    def calibration_key(self, mode: ModeRecipe) -> str | None:
        return _KEY if mode.option("quantizer", "static") == "static" else None

    def calibrate(self, key, bank, windows, settings, depth, prefix_hashes, cache_dir, *, progress=None):
        return calibrate_static(bank, windows, settings, depth, prefix_hashes, cache_dir, progress=progress)

    def mode_problem(self, mode: ModeRecipe) -> str | None:
        bad = set(dict(mode.options)) - {"quantizer"}
        if bad or mode.option("quantizer", "static") not in ("static", "dynamic"):
            return "naive takes one option, quantizer = static or dynamic"
        return None

    def build_blocks(self, mode, bank, scales, depth, calibration=False):
        if self.calibration_key(mode) is not None:
            if scales is None:
                raise ValueError(f"mode {mode.name!r} needs its static scales (calibration {_KEY!r})")
            return build_static(mode, bank, scales, depth)
        return build_dynamic(mode, bank, depth)


_MODES = (
    ModeRecipe("naive-static", "naive W8A8, static per-tensor (Quamba1 fake path, no flags)", **FLOAT_KNOBS,
               family="naive", options={"quantizer": "static"}),
    ModeRecipe("naive-dynamic", "naive W8A8, dynamic per-tensor (PTQ-SSM W8A8Linear)", **FLOAT_KNOBS,
               family="naive", options={"quantizer": "dynamic"}),
)
Naive.modes = _MODES
register_recipe(Naive())
