"""The run context: what the steps of one run share, built once by the pipeline.

The pipeline builds one ``RunContext`` after the inputs are checked and the calibration is done;
the mode loop and the studies take it. ``ModeLoopResult`` is what the mode loop hands the studies.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ..recipes.registry import recipe_for
from ..modes import ModeRecipe
from ..runtime.guard import Progress
from ..spec import LayerScales
from .calibration import CalibrationResult
from .config import RunConfig
from .forwards import RefInputs
from .weightbank import WeightBank

__all__ = ["RunContext", "ModeLoopResult"]


@dataclass
class RunContext:
    """One run's shared inputs.

    samples: the disjoint windows of the sample, each (1, seq_len) int64.
    points: the capture points, in capture order; depth: the deepest block that runs.
    calibs: prep -> its calibration result, or the exception that made it fail.
    progress: what the run is doing and what is on disk (read when a signal interrupts it).
    """

    cfg: RunConfig
    bank: WeightBank
    calibs: dict[str, CalibrationResult | Exception]
    samples: list[torch.Tensor]
    points: list[str]
    depth: int
    progress: Progress
    emit: Callable[[str], None]
    decode_ids: torch.Tensor | None = None  # --decode N: (1, L + N), the prompt and the teacher-forced tokens
    units: object | None = None  # runner.dispatch.Dispatcher: the units run in other processes (None: here)

    def scales(self, recipe: ModeRecipe) -> list[LayerScales] | None:
        """The calibrated scales of the recipe's prep (None for float recipes); a failed calibration raises."""
        key = recipe_for(recipe).calibration_key(recipe)  # None: the mode reads no calibration
        calib = self.calibs.get(key) if key is not None else None
        if isinstance(calib, Exception):
            raise RuntimeError(f"calibration failed: {calib}")
        return calib.scales if isinstance(calib, CalibrationResult) else None

    def keep_calibrations(self, recipes: list[ModeRecipe]) -> None:
        """Forget the calibration results that none of `recipes` (the modes still to run) reads: a W4 recipe's
        are its GPTQ weights (about 90 MB for a 24-layer 130m Mamba-2), held until the run ends otherwise."""
        needed = {recipe_for(r).calibration_key(r) for r in recipes}
        for key in [k for k in self.calibs if k not in needed]:
            del self.calibs[key]

    def head_scale(self, recipe: ModeRecipe) -> float | None:
        """lm_head=quantized: the lm_head:input scale observed with the recipe's calibration (recipes.quamba.q2.head_scale)."""
        calib = self.calibs.get(recipe_for(recipe).calibration_key(recipe))
        return calib.info.get("lm_head_input_scale") if isinstance(calib, CalibrationResult) else None


@dataclass
class ModeLoopResult:
    """What the mode loop leaves for the studies and the provenance.

    rows: mode -> per-sample comparison rows (samples > 1); e2e: mode -> per-sample end-to-end rows;
    ref_logits: the reference's logits per sample, (1, seq_len, vocab) each; ref_inputs: its block inputs;
    shared_ops: what the modes shared (runner.sharedops summary).
    """

    rows: dict[str, dict] = field(default_factory=dict)
    e2e: dict[str, list[dict]] = field(default_factory=dict)
    ref_logits: list[np.ndarray] | None = None
    ref_inputs: RefInputs | None = None
    shared_ops: dict | None = None
    ref_generated: np.ndarray | None = None  # --generate: the reference's greedy ids (1, N)
