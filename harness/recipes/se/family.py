"""The recipe family of the research fork 798253405/Quamba-SE (``quamba-se``): its modes run on Quamba1's W8A8 block
of Mamba-1 (only W8A8QMamba has the mixer methods, and only a pre-quantized Quamba checkpoint the model-level
forwards: quamba/quamba_mixer_seq.py:519-1180, main.py:52-71 at f4d350a), prepared and calibrated as Quamba1 does.
The calibration is Quamba1's own, asked of the registry (recipe folders do not import each other); 6-4 adds a
second one at percentile alpha = 1.0, whose conv output scale is its outlier scale (qMambaLayer.py:12-20,
2690-2723; the fork reads it from a hard-coded pa-1 checkpoint and falls back to s when that is missing)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ...modes import ModeRecipe
from ...spec import LayerScales
from ..registry import Recipe, get_recipe
from .block import build_se_blocks
from .modes import FAMILY, SE_KNOBS, SE_MODES, knobs_of

__all__ = ["QuambaSE", "SeLayerScales", "PA1_KEY", "PA1_ALPHA"]

PA1_KEY = "quamba+pa1"  # the calibration of 6-4: Quamba1's, plus the conv output scale at alpha = 1.0
PA1_ALPHA = 1.0
_MAMBA1 = "mamba1"


@dataclass(frozen=True)
class SeLayerScales(LayerScales):
    """Quamba1's scales of a layer and 6-4's outlier scale (the alpha = 1.0 calibration's s_u)."""

    s_out: float = 0.0


class QuambaSE(Recipe):
    """Modes 4, 5-0…5-7, 6-0…6-4 of the Quamba-SE fork, as written, and their +fixed/+striped/+exactdiv variants."""

    name = FAMILY
    title = "Quamba-SE (798253405/Quamba-SE): virtual INT8, outliers, dual scales, log2 and three-segment grids"
    modes = SE_MODES

    def architectures(self, mode: ModeRecipe) -> tuple[str, ...]:
        return (_MAMBA1,)

    def architecture_problem(self, mode: ModeRecipe, architecture: str) -> str | None:
        if architecture == _MAMBA1:
            return None
        return ("the Quamba-SE fork defines it on Quamba1's W8A8 Mamba-1 block only (W8A8QMamba's forward_mode5/6 "
                "methods, quamba/qMambaLayer.py:1404-2822)")

    def model_problem(self, mode: ModeRecipe, dims) -> str | None:
        """A mode of this family that is not one of its rows (a --modes_file mode naming family quamba-se) has no
        SE knobs to run."""
        if mode.name in SE_KNOBS:
            return None
        return (f"family {FAMILY} runs its own modes only ({', '.join(SE_KNOBS)}); a modes file cannot define "
                f"another (its knobs beyond the base row are the family's table, harness/recipes/se/modes.py)")

    def extra_knobs(self, mode: ModeRecipe) -> dict | None:
        return knobs_of(mode).as_dict() if mode.name in SE_KNOBS else None

    def decode_problem(self, mode: ModeRecipe) -> str | None:
        return (f"mode {mode.name} is prefill/log-likelihood only: the fork's eval forwards ignore the inference cache "
                "(they never read or update conv_state/ssm_state and have no step path, quamba/qMambaLayer.py:"
                "1404-2822 at f4d350a), so decoding with it would be wrong")

    def calibration_key(self, mode: ModeRecipe) -> str | None:
        return PA1_KEY if knobs_of(mode).u == "dual-cal" else "quamba"

    def calibrate(self, key, bank, windows, settings, depth, prefix_hashes, cache_dir, *, progress=None):
        quamba1 = get_recipe("quamba1")
        main = quamba1.calibrate("quamba", bank, windows, settings, depth, prefix_hashes, cache_dir, progress=progress)
        if key != PA1_KEY:
            return main
        pa1 = quamba1.calibrate("quamba", bank, windows, replace(settings, alpha=PA1_ALPHA), depth, prefix_hashes,
                                cache_dir, progress=progress)
        scales = [SeLayerScales(**asdict(s), s_out=o.s_u) for s, o in zip(main.scales, pa1.scales)]
        info = {**main.info, "prep": PA1_KEY, "s_out": [o.s_u for o in pa1.scales],
                "pa1": {k: v for k, v in pa1.info.items() if k != "observers"}}
        return type(main)(scales, info)

    def build_blocks(self, mode, bank, scales, depth, calibration=False):
        return build_se_blocks(mode, bank, scales, depth, calibration)
