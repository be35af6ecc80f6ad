"""Quamba2's W4AX (``--hybrid_blocks``): per Mamba-2 layer W4A8 or W4A16, as a ``hybrid_blocks_config.json`` says.

Mode ``q2-w4ax`` (family ``quamba2-w4ax``), option ``blocks_config``: the path of Quamba's config file (a JSON list of
"W4A8"/"W4A16", one per layer; recipes.quamba.w4.hybrid_config), e.g. in a modes file
``{"modes": {"w4ax-mix": {"base": "q2-w4ax", "options": {"blocks_config": "hybrid_blocks_config.json"}}}}`` (a
relative path is read from the working directory, as upstream's ``open(args.hybrid_blocks_config)``). Without it
every layer is W4A8, upstream's default (quamba/modelutils_mamba.py:715-732, enyac-group/Quamba c474646).

What runs (quantize_model_mamba, modelutils_mamba.py:761-844; quantize_fp16_model_act_hybrid, :670-746):
* one calibration, key "quamba2-w4ax" (recipes.quamba.w4.calibrate_w4ax): q2-w8a8's scales and reorder, then one
  GPTQ of the reordered model; layer i is q2-w4a8's block (bit for bit) where the config says W4A8, else the W4A16
  block (q2-w4a16's: fp16 norm, conv and SSD, Marlin linears) on the reordered tensors and the same GPTQ's codes;
* the embedding is W4O16Embedding (int4 rows, fp16 scales), hard-coded upstream (:686-688): knob embedding=int4;
* the head: upstream hard-codes QRMSNorm at lm_head:input's scale and a W4A8B16O16Linear lm_head (:740-743, "FIXME
  hard-fix"): knob lm_head=quantized, as q2-w4a8 with lm_head=quantized (runner.head,
  kernels.embedding_head.w4_lm_head), its scale the W8A8 calibration's lm_head:input (recipes.quamba.q2.head_scale).
  Upstream's head codes are apply_gptq's fp16 GPTQ of lm_head (:478-507); the harness's are Marlin-QQQ's round to
  nearest (what from_fp16 does to a head GPTQ did not run on). A modes file may set lm_head=fp16 (q2-w4a8's head).

Upstream runs W4AX on Mamba-2 only (ValueError otherwise, :735-736): so does the mode (not on Mamba-1, nor on the
hybrids' Mamba-2 layers). No W4AX checkpoint is exported or read (docs/quamba2-checkpoints.md).
"""
from __future__ import annotations

from dataclasses import replace

from ...modes import BUILTIN_MODES, KNOBS, ModeRecipe
from .families import Quamba2W4
from .q2.calibration import q2_grouping_problem
from .q2.params import reorder_raw
from .w4.build import build_q2w4_mamba2_block
from .w4.calibrate_w4ax import W4AX_KEY, W4AXLayer, calibrate_q2w4ax
from .w4.hybrid_config import BLOCK_KINDS, config_problem, layer_blocks, length_problem

__all__ = ["Quamba2W4AX", "FAMILY", "build_w4ax_blocks", "blocks_config_of"]

FAMILY = "quamba2-w4ax"
_OPTION = "blocks_config"
_FREE = ("ssm_impl",)  # the knobs a modes file may change (and embedding, lm_head): the rest is W4A8's / W4A16's per layer


def blocks_config_of(mode: ModeRecipe) -> str | None:
    """The mode's config path, or None (every layer W4A8)."""
    return dict(mode.options).get(_OPTION)


def build_w4ax_blocks(mode: ModeRecipe, bank, scales: list[W4AXLayer], depth: int) -> list:
    """Blocks 0..depth: layer i q2-w4a8's block or the W4A16 block on the reordered tensors (module docstring)."""
    dims = bank.dims
    kinds = layer_blocks(blocks_config_of(mode), dims.n_layer)
    w4a8 = replace(BUILTIN_MODES["q2-w4a8"], ssm_impl=mode.ssm_impl, state_dtype=mode.state_dtype)
    w4a16 = replace(BUILTIN_MODES["q2-w4a16"], ssm_impl=mode.ssm_impl)
    out = []
    for i in range(depth + 1):
        s = scales[i]
        if kinds[i] == "W4A8":  # W4A8QMamba2.from_fp16 (quantize_mixer_w4a8, modelutils_mamba.py:549)
            out.append(build_q2w4_mamba2_block(w4a8, bank.raw(i), s.w4a8, dims, i))
        else:  # W4A16QMamba2.from_fp16 of the reordered model (reorder_mamba reorders every tensor, :806)
            raw = reorder_raw(bank.raw(i), s.scales.reorder, dims.d_inner, dims.nheads)
            out.append(build_q2w4_mamba2_block(w4a16, raw, s.w4a16, dims, i))
    return out


class Quamba2W4AX(Quamba2W4):
    """Quamba2's W4AX: per layer W4A8 or W4A16 from one reordered GPTQ (module docstring)."""

    name = FAMILY
    title = "Quamba2 W4AX: per-layer W4A8 / W4A16 (hybrid_blocks_config.json) from one GPTQ, Mamba-2"
    modes = (replace(BUILTIN_MODES["q2-w4a8"], name="q2-w4ax", family=FAMILY, embedding="int4", lm_head="quantized",
                     title="Quamba2 W4AX: per-layer W4A8/W4A16 (option blocks_config), int4 embedding, W4A8 head"),)

    def owns(self, mode: ModeRecipe) -> bool:
        return mode.family == self.name

    def architectures(self, mode: ModeRecipe) -> tuple[str, ...]:
        return ("mamba2",)

    def architecture_problem(self, mode: ModeRecipe, architecture: str) -> str | None:
        if architecture == "mamba2":
            return None
        return ("Quamba's W4AX (--hybrid_blocks) runs on mamba2 models only (quantize_fp16_model_act_hybrid raises "
                "ValueError for any other model_type, quamba/modelutils_mamba.py:735-736); on this model run q2-w4a8 "
                "or q2-w4a16 where they run")

    def on_architecture(self, mode: ModeRecipe, architecture: str | None) -> ModeRecipe:
        return mode

    def mode_problem(self, mode: ModeRecipe) -> str | None:
        base = self.modes[0]
        fixed = [f"{k}={getattr(mode, k)}" for k in KNOBS if k not in _FREE and getattr(mode, k) != getattr(base, k)]
        if fixed:
            return (f"{', '.join(fixed)}: the knobs of q2-w4ax are each layer's W4A8 or W4A16 recipe (its "
                    f"blocks_config); a modes file may change ssm_impl, embedding, lm_head and the option {_OPTION} only")
        bad = sorted(set(dict(mode.options)) - {_OPTION})
        if bad:
            return (f"unknown option(s) {', '.join(bad)}; valid: {_OPTION} (the path of Quamba's "
                    f"hybrid_blocks_config.json: a JSON list of {' or '.join(BLOCK_KINDS)}, one per layer)")
        return config_problem(blocks_config_of(mode))

    def model_problem(self, mode: ModeRecipe, dims) -> str | None:
        if dims.architecture != "mamba2":
            return None
        return length_problem(blocks_config_of(mode), dims.n_layer) or q2_grouping_problem(dims)

    def calibration_key(self, mode: ModeRecipe) -> str | None:
        return W4AX_KEY

    def calibrate(self, key, bank, windows, settings, depth, prefix_hashes, cache_dir, *, progress=None):
        return calibrate_q2w4ax(bank, windows, settings, depth, prefix_hashes, cache_dir, progress=progress)

    def build_blocks(self, mode, bank, scales, depth, calibration=False):
        return build_w4ax_blocks(mode, bank, scales, depth)

    def extra_knobs(self, mode: ModeRecipe) -> dict | None:
        """The per-layer blocks, recorded as the stats' family_knobs: "layer_blocks" the config's list joined by
        commas (without a config: "W4A8 (every layer)", upstream's default)."""
        path = blocks_config_of(mode)
        if path is None:
            return {_OPTION: "", "layer_blocks": "W4A8 (every layer)"}
        return {_OPTION: path, "layer_blocks": ",".join(layer_blocks(path, 0))}
