"""The recipe families of enyac-group/Quamba, as the registry sees them: Quamba1's W8A8 (``quamba1``), Quamba2's
W8A8 of Mamba-2 (``quamba2``), and Quamba2's GPTQ W4A8 / W4A16 (``quamba2-w4``), which on a Mamba-1 model take
Quamba1's preparation and calibration (Quamba2 prepares a Mamba-1 model as Quamba1 does: configure_model's "mamba"
branch, quamba/modelutils_mamba.py:58-81). One folder, since Quamba2's code is built on Quamba1's.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ...modes import BUILTIN_MODES, ModeRecipe, Prep, Weights
from ..registry import Recipe
from .calibration import calibrate
from .q2.build import build_blocks as q2_blocks
from .q2.calibration import q2_grouping_problem, ssm_dims
from .q2.hybrid import build_q2_hybrid_blocks
from .q2.calibrate import calibrate_quamba2
from .q2.head_scale import head_problem, observe_head_scales
from .w4.build import build_blocks_mamba1, build_blocks_mamba2
from .w4.calibrate_mamba1 import calibrate_mamba1_w4
from .w4.calibrate_mamba2 import calibrate_q2w4

__all__ = ["Quamba1", "Quamba2", "Quamba2W4", "Quamba2HybridW8A8", "calibrate_key"]

_MAMBA1, _MAMBA2 = "mamba1", "mamba2"
# the architectures whose blocks are Mamba-1's (Falcon-Mamba adds weightless dt/B/C norms, which the block's knob
# interpreter quantizes as x_proj's output: architectures.mamba1.build.mixer_norms): every Mamba-1 recipe runs there
_MAMBA1_BLOCKS = (_MAMBA1, "falcon_mamba")
# the hybrids whose SSM blocks are Mamba-2's: Quamba2's W8A8, W4A8 and W4A16 quantize those, the attention and MLP
# blocks stay fp16
_HYBRIDS = ("bamba", "nemotron_h")


def calibrate_key(bank, windows, settings, depth: int, prefix_hashes: list[str], cache_dir: Path | None,
                  key: str = "quamba", *, progress=None):
    """The calibration of any Quamba key: "quamba"/"exact" (Quamba1's observers), "quamba2" (Quamba2's two passes),
    "quamba2-w4a8"/"quamba2-w4a16" (GPTQ, on the model's architecture)."""
    args = (bank, windows, settings, depth, prefix_hashes, cache_dir)
    if key == "quamba2":
        return calibrate_quamba2(*args, progress=progress)
    if key in ("quamba2-w4a8", "quamba2-w4a16"):
        w4 = calibrate_mamba1_w4 if bank.dims.architecture in _MAMBA1_BLOCKS else calibrate_q2w4
        return w4(*args, key, progress=progress)
    return calibrate(*args, key, progress=progress)


class _Quamba(Recipe):
    def calibrate(self, key, bank, windows, settings, depth, prefix_hashes, cache_dir, *, progress=None):
        return calibrate_key(bank, windows, settings, depth, prefix_hashes, cache_dir, key, progress=progress)


class Quamba1(_Quamba):
    """Quamba1's W8A8 recipe of Mamba-1 blocks and its variants (modes 0, 2-x, 3), and any mode with prep=quamba."""

    name = "quamba1"
    title = "Quamba1 W8A8 (static per-tensor int8, Hadamard-rotated), Mamba-1"

    def owns(self, mode: ModeRecipe) -> bool:
        return mode.weights != Weights.INT4 and mode.prep != Prep.QUAMBA2 and \
            (mode.needs_calibration or mode.prep == Prep.QUAMBA)

    def architectures(self, mode: ModeRecipe) -> tuple[str, ...]:
        return _MAMBA1_BLOCKS

    def architecture_problem(self, mode: ModeRecipe, architecture: str) -> str | None:
        if architecture in self.architectures(mode):
            return None
        if mode.needs_calibration:
            return ("it quantizes (Quamba1's W8A8 recipe of Mamba-1 blocks); on Mamba-2 the float recipes run "
                    "(weights fp32/fp16, every output fp, no int8 activations) and Quamba2's (q2-w8a8, q2-w4a8, q2-w4a16)")
        return "prep=quamba prepares Mamba-1 weights as Quamba1 does; use prep=exact on Mamba-2"


class Quamba2(_Quamba):
    """Quamba2's W8A8 of Mamba-2 blocks (q2-w8a8 and its variant knobs)."""

    name = "quamba2"
    title = "Quamba2 W8A8 (head/dim-grouped int8 SSD input), Mamba-2"

    def owns(self, mode: ModeRecipe) -> bool:
        return not mode.family and mode.prep == Prep.QUAMBA2 and mode.weights != Weights.INT4

    def architectures(self, mode: ModeRecipe) -> tuple[str, ...]:
        return (_MAMBA2, *_HYBRIDS)

    def architecture_problem(self, mode: ModeRecipe, architecture: str) -> str | None:
        if architecture in self.architectures(mode):
            return None
        return ("it is Quamba2's W8A8 of Mamba-2 blocks; Quamba2's W8A8 of a Mamba-1 model is Quamba1's "
                "(its head-grouped calibration raises NotImplementedError for Mamba-1, quamba/modelutils_mamba.py:"
                "240-241): run mode 0 there (q2-w4a8 and q2-w4a16 run on both)")

    def model_problem(self, mode: ModeRecipe, dims) -> str | None:
        """The head/dim grouping export checks (q2.export.check_q2_export), before any work."""
        if dims.architecture not in (_MAMBA2, *_HYBRIDS):
            return None
        return head_problem(mode, dims.architecture) or q2_grouping_problem(ssm_dims(dims))

    def build_blocks(self, mode, bank, scales, depth, calibration=False):
        build = build_q2_hybrid_blocks if bank.dims.architecture in _HYBRIDS else q2_blocks
        return build(mode, bank, scales, depth, calibration)

    def after_calibration(self, calibs, modes, bank, windows, settings, cache_dir, progress) -> None:
        """lm_head=quantized: lm_head's input scale, observed after the calibration (q2.head_scale)."""
        observe_head_scales(calibs, [m for m in modes if self.owns(m)], bank, windows, settings, cache_dir, progress)


class Quamba2W4(_Quamba):
    """Quamba2's GPTQ int4 recipes (q2-w4a8: Marlin-QQQ with W8A8 activations; q2-w4a16: Marlin, fp16)."""

    name = "quamba2-w4"
    title = "Quamba2 W4A8 / W4A16 (GPTQ int4, Marlin), Mamba-1, Mamba-2 and the hybrids' Mamba-2 blocks"

    def owns(self, mode: ModeRecipe) -> bool:
        return mode.weights == Weights.INT4

    def architectures(self, mode: ModeRecipe) -> tuple[str, ...]:
        return _MAMBA1_BLOCKS + (_MAMBA2, *_HYBRIDS)

    def on_architecture(self, mode: ModeRecipe, architecture: str | None) -> ModeRecipe:
        """On Mamba-1, Quamba1's preparation (prep=quamba)."""
        if architecture in _MAMBA1_BLOCKS and mode.prep == Prep.QUAMBA2:
            return replace(mode, prep=Prep.QUAMBA)
        return mode

    def model_problem(self, mode: ModeRecipe, dims) -> str | None:
        """W4A8 on Mamba-2: Quamba2's head/dim grouping of the int8 SSD input (as check_q2_export, which
        export_mamba2's check_q2w4_export adds to); W4A16 quantizes no activation and needs none. Marlin's
        128-multiples bind the packed export only (the run emulates the packing)."""
        if dims.architecture not in (_MAMBA2, *_HYBRIDS):
            return None
        if head_problem(mode, dims.architecture) or self.calibration_key(mode) != "quamba2-w4a8":
            return head_problem(mode, dims.architecture)
        return q2_grouping_problem(ssm_dims(dims))

    def after_calibration(self, calibs, modes, bank, windows, settings, cache_dir, progress) -> None:
        """lm_head=quantized of a W4A8 recipe: lm_head's input scale, as q2-w8a8's (q2.head_scale)."""
        if bank.dims.architecture == _MAMBA2:
            observe_head_scales(calibs, [m for m in modes if self.owns(m)], bank, windows, settings, cache_dir,
                                progress, key_of=self.calibration_key)

    def build_blocks(self, mode, bank, scales, depth, calibration=False):
        build = build_blocks_mamba1 if bank.dims.architecture in _MAMBA1_BLOCKS else build_blocks_mamba2
        return build(mode, bank, scales, depth, calibration)


# mode -> the KV cache format of its attention blocks (q2.linear.KV_FORMATS)
_HYBRID_KV = {"q2-w8a8-a8": "fp16", "q2-w8a8-a8-kv8": "int8", "q2-w8a8-a8-kvfp8": "fp8_e4m3"}
_HYBRID_FAMILY = "quamba2-hybrid-w8a8"


class Quamba2HybridW8A8(Quamba2):
    """q2-w8a8 on a hybrid whose attention and MLP linears are W8A8 too (static per-tensor int8 inputs, per-channel
    int8 weights: q2.linear), the KV cache in fp16 (q2-w8a8-a8), int8 (-kv8) or fp8 E4M3 (-kvfp8). The calibration
    is q2-w8a8's (one pass observes both)."""

    name = _HYBRID_FAMILY
    title = "Quamba2 W8A8 of a hybrid's Mamba-2 blocks, W8A8 attention and MLP linears, KV cache fp16/int8/fp8"
    modes = tuple(replace(BUILTIN_MODES["q2-w8a8"], name=n, family=_HYBRID_FAMILY,
                          title=f"Quamba2 W8A8 + W8A8 attention/MLP linears, KV cache {kv}")
                  for n, kv in _HYBRID_KV.items())

    def owns(self, mode: ModeRecipe) -> bool:
        return mode.family == self.name

    def architectures(self, mode: ModeRecipe) -> tuple[str, ...]:
        return _HYBRIDS

    def architecture_problem(self, mode: ModeRecipe, architecture: str) -> str | None:
        if architecture in _HYBRIDS:
            return None
        return "it quantizes a hybrid's attention and MLP linears; a model without them runs q2-w8a8"

    def build_blocks(self, mode, bank, scales, depth, calibration=False):
        return build_q2_hybrid_blocks(mode, bank, scales, depth, calibration, linear_kv=_HYBRID_KV[mode.name])
