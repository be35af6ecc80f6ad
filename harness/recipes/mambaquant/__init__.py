"""MambaQuant (ICLR 2025; MambaQuant/MambaQuant@a4803c4) on Mamba-1 (docs/field-recipes.md "MambaQuant"):
``mambaquant-w8a8`` (its rotations and smoothings, asymmetric dynamic per-sequence 8-bit activations,
per-channel asymmetric 8-bit weights clipped at the 0.999999 percentile), ``mambaquant-w8a8+quamba`` (the same
transforms under Quamba's static per-tensor symmetric quantizer, calibrated on the transformed model) and
``mambaquant-w8a8+transform`` (the transforms alone: equal to fp32 within rounding). Options: ``upstream``
(as-meant | as-written: the release's defects), ``seed`` (the Hadamard signs). Mamba-1 only: the release has no
Mamba-2 language model. Importing the package registers the family."""
from __future__ import annotations

import torch

from ...emulation.modules import EmuBackbone
from ...modes import ModeRecipe
from ...runner.statcache import cached_statistics
from ..registry import Recipe, register_recipe
from .blocks import MQ_POINTS, build, observers_for
from .calibration import calibrate_mq
from .gptq import gptq_layers

__all__ = ["MambaQuant", "mq_options"]

_KNOBS = dict(weights="fp32", rotate="no", norm_out="fp", in_proj_out="fp", conv_in="static", conv_out="fp32",
              ssm_u="fp32", ssm_impl="reference", had_out="fp", act_dtype="fp32", prep="exact")
_VALID = {"bits": ("8", "4"), "quantizer": ("mambaquant", "quamba", "none"), "upstream": ("as-meant", "as-written")}


def mq_options(mode: ModeRecipe) -> dict:
    return {"bits": int(mode.option("bits", "8")), "quantizer": mode.option("quantizer", "mambaquant"),
            "upstream": mode.option("upstream", "as-meant"), "seed": int(mode.option("seed", "0"))}


def _static_scale(amax: float) -> float:
    return float(torch.tensor(max(amax, 1e-5), dtype=torch.float32) / 127)


class MambaQuant(Recipe):
    name = "mambaquant"
    title = "MambaQuant: KLT x Hadamard rotations, smoothing, asymmetric dynamic W8A8 (Mamba-1)"

    def architectures(self, mode: ModeRecipe) -> tuple[str, ...]:
        return ("mamba1",)

    def architecture_problem(self, mode: ModeRecipe, architecture: str) -> str | None:
        if architecture == "mamba1":
            return None
        return ("MambaQuant is defined for Mamba-1 only (its language code, model_llm/, splits transformers' "
                "MambaMixer; the release has no Mamba-2 language model): on Mamba-2 run naive-static, "
                "naive-dynamic or q2-w8a8")

    def mode_problem(self, mode: ModeRecipe) -> str | None:
        opts = dict(mode.options)
        unknown = sorted(set(opts) - set(_VALID) - {"seed"})
        if unknown:
            return f"unknown option(s) {', '.join(unknown)}; valid: bits, quantizer, upstream, seed"
        for k, allowed in _VALID.items():
            if k in opts and opts[k] not in allowed:
                return f"option {k}={opts[k]!r} is not valid; valid: {', '.join(allowed)}"
        if "seed" in opts and not opts["seed"].isdigit():
            return f"option seed={opts['seed']!r} is not valid; valid: a non-negative integer"
        return None

    def calibration_problem(self, mode: ModeRecipe, settings) -> str | None:
        tokens = settings.num_samples * settings.seqlen
        if tokens < 2:
            return (f"its KLT needs a covariance of the activations, which is not finite with {tokens} calibration "
                    f"token(s); give at least 2 (--calib_data_num x --calib_seqlen)")
        return None

    def calibration_key(self, mode: ModeRecipe) -> str | None:
        o = mq_options(mode)
        base = "mambaquant" + ("@as-written" if o["upstream"] == "as-written" else "")
        if o["bits"] == 4 and o["quantizer"] == "mambaquant":
            return base + f"+gptq4@seed={o['seed']}"
        return base + (f"+quamba@seed={o['seed']}" if o["quantizer"] == "quamba" else "")

    def calibrate(self, key, bank, windows, settings, depth, prefix_hashes, cache_dir, *, progress=None):
        as_written = "@as-written" in key
        mode = _MODES[0]
        if as_written and depth < bank.dims.n_layer - 1:  # R2's stale index reads the last layer's KLT
            full = calibrate_mq(mode, bank, windows, settings, bank.dims.n_layer - 1, prefix_hashes, None)
            stats = full.scales
        else:
            full = calibrate_mq(mode, bank, windows, settings, depth, prefix_hashes, cache_dir)
            stats = full.scales
        if "+quamba" not in key and "+gptq4" not in key:
            return full
        seed = int(key.rsplit("=", 1)[1])
        if "+gptq4" in key:
            return self._gptq(key, bank, windows, settings, depth, prefix_hashes, cache_dir, full, seed)
        opts = {"bits": 8, "quantizer": "quamba", "upstream": "as-written" if as_written else "as-meant", "seed": seed}

        def compute():
            obs = observers_for(depth)
            blocks = build(mode, bank, stats, depth, opts, observers=obs)
            model = EmuBackbone(lambda ids: bank.embed(ids, False, torch.float32, "exact", "fp32"), blocks)
            for batch in windows.split(settings.batch_size):
                model(batch)
            return [{f"q_{n}": _static_scale(o[n].amax) for n in MQ_POINTS} for o in obs]
        static = cached_statistics("mambaquant-quamba", key, windows, settings, depth, prefix_hashes, cache_dir,
                                   compute=compute, extra={"seed": seed})
        static.info["transform_statistics"] = {k: v for k, v in full.info.items() if k in ("source", "keys", "statistics")}
        static.scales = [{**s, **q} for s, q in zip(stats, static.scales)] + stats[depth + 1:]
        return static

    def _gptq(self, key, bank, windows, settings, depth, prefix_hashes, cache_dir, full, seed):
        stats = full.scales
        opts = {"bits": 4, "quantizer": "mambaquant", "upstream": "as-written" if "@as-written" in key else "as-meant",
                "seed": seed}
        result = cached_statistics("mambaquant-gptq", key, windows, settings, depth, prefix_hashes, cache_dir,
                                   compute=lambda: gptq_layers(_MODES[0], bank, windows, settings.batch_size, depth,
                                                               stats, opts), extra={"seed": seed})
        result.info["transform_statistics"] = {k: v for k, v in full.info.items()
                                               if k in ("source", "keys", "statistics")}
        result.scales = [{**s, **g} for s, g in zip(stats, result.scales)] + stats[depth + 1:]
        return result

    def build_blocks(self, mode, bank, scales, depth, calibration=False):
        if scales is None:
            raise ValueError(f"mode {mode.name!r} needs its calibration statistics ({self.calibration_key(mode)})")
        opts = mq_options(mode)
        static = [{n: s[f"q_{n}"] for n in MQ_POINTS} for s in scales[: depth + 1]] \
            if opts["quantizer"] == "quamba" else None
        return build(mode, bank, scales, depth, opts, scales=static)


_MODES = (
    ModeRecipe("mambaquant-w8a8", "MambaQuant W8A8: KLT x Hadamard + smoothing, asym dynamic per-sequence", **_KNOBS,
               family="mambaquant", options={"bits": "8", "quantizer": "mambaquant"}),
    ModeRecipe("mambaquant-w8a8+quamba", "MambaQuant's transforms under Quamba's static per-tensor W8A8", **_KNOBS,
               family="mambaquant", options={"bits": "8", "quantizer": "quamba"}),
    ModeRecipe("mambaquant-w4a8", "MambaQuant W4A8: its transforms, GPTQ 4-bit per-channel weights, asym dynamic "
               "8-bit activations", **_KNOBS, family="mambaquant", options={"bits": "4", "quantizer": "mambaquant"}),
    ModeRecipe("mambaquant-w8a8+transform", "MambaQuant's rotations and smoothings alone: fp32 within rounding",
               **_KNOBS, family="mambaquant", options={"bits": "8", "quantizer": "none"}),
)
MambaQuant.modes = _MODES
register_recipe(MambaQuant())
