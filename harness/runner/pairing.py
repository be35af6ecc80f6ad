"""The models of one run: a float checkpoint, or a Quamba checkpoint with (optionally) its float model.

With a Quamba checkpoint, int8 rotated prep=quamba recipes run from its codes and scales; recipes
with float weights (``fp32``, ``1``), without rotation or with prep=exact need the float model
(``--mamba_model_path``). The pair is checked: equal dimensions (else an error), and the float model's
weights, prepared and quantized by the same code as the built-in int8 modes
(``WeightBank.layer(i, "int8", True, "quamba")``), should land within one code of the checkpoint's (the fraction is reported; below ``PAIR_MIN_FRACTION`` a warning says the pair is
probably mismatched).
"""
from __future__ import annotations

import re
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path

from .calibration import CalibrationResult
from ..runtime.log import warn
from ..modes import Prep, Rotate, Weights
from ..checkpoints.loading import Checkpoint, ModelDirError, open_checkpoint, refuse_in
from ..checkpoints.tokenizer import Tokenizer, load_tokenizer
from ..recipes.registry import CheckpointFormat, checkpoint_formats, recipe_for
from ..store.files import is_regular
from .weightbank import WeightBank

__all__ = ["Models", "open_models", "check_pair", "checkpoint_calibration", "needs_float"]

_DIMS = ("d_model", "d_inner", "d_state", "d_conv", "dt_rank", "n_layer")
_DIMS2 = ("ngroups", "headdim", "nheads", "chunk_size")  # Mamba-2 (a Quamba2 checkpoint)


@dataclass
class Models:
    bank: WeightBank
    primary: object   # the --model directory: a Checkpoint, or a registered format's reader
    float_ckpt: Checkpoint | None
    quamba: object | None  # the quantized checkpoint (recipes.registry.CheckpointFormat.open), if any
    format: CheckpointFormat | None = None  # the registered format of the quantized checkpoint

    @property
    def tokenizer_dirs(self) -> list[Path]:
        return [self.primary.path] + ([self.float_ckpt.path] if self.quamba and self.float_ckpt else [])

    def gives_scales(self, key: str) -> bool:
        """A Quamba checkpoint holds the scales (and codes) of one calibration key (prep=quamba, quamba2, or
        Quamba2's W4 "quamba2-w4a8"/"quamba2-w4a16"): no calibration for those."""
        return self.quamba is not None and key == getattr(self.quamba, "calibration_key", self.quamba.prep)

    def needs_calibration(self, recipes) -> bool:
        """Whether some recipe needs scales that must be calibrated (so the calibration text is read)."""
        keys = [recipe_for(r).calibration_key(r) for r in recipes]
        return any(k is not None and not self.gives_scales(k) for k in keys)

    def tokenizer(self, tokenizer_dir: Path | None = None) -> Tokenizer:
        """--tokenizer, else the model directory, else (Quamba checkpoints carry none) the float model's."""
        if tokenizer_dir is not None:
            return load_tokenizer(self.primary.path, tokenizer_dir)
        dirs = self.tokenizer_dirs
        for d in dirs[1:]:
            files = [Path(dirs[0]) / n for n in ("tokenizer.json", "vocab.json")]
            if not any([is_regular(f, refuse_in(f)) for f in files]):  # a FIFO there is named, not skipped
                return load_tokenizer(d)
        return load_tokenizer(dirs[0])

    def pairing(self, depth: int, checked: Future | None = None) -> dict:
        """check_pair, with a warning on stderr when the two probably do not belong together.

        checked: check_pair(self, depth) already submitted to a thread (its result, or its error, is taken here).
        """
        pairing = check_pair(self, depth) if checked is None else checked.result()
        if not pairing["matched"]:
            warn(f"only {pairing['within_one_code']:.2%} of the weight codes of {self.quamba.path} "
                 f"(layers 0..{depth}) lie within one code of {self.float_ckpt.path} quantized as Quamba does "
                 f"(expected >= 99%): the two probably do not belong together")
        return pairing


def _float_dir(path: Path, model_name: str) -> Path:
    """The research tool passes the parent of the float model; accept DIR or DIR/mamba-<size> (the name
    Quamba derives a quantized model's name from, modelutils_mamba.py:776, reversed)."""
    if is_regular(path / "config.json", refuse_in(path / "config.json")):
        return path
    guess = re.sub(r"^quamba", "mamba", model_name.lower())
    guess = re.sub(r"-w\d+a\d+$", "", guess)
    if is_regular(path / guess / "config.json", refuse_in(path / guess / "config.json")):
        return path / guess
    raise ModelDirError(f"--mamba_model_path {path}: no config.json there (nor in {path / guess}); "
                        f"it must name the float model's directory (transformers or mamba_ssm layout)")


def open_models(model: Path, mamba_model_path: Path | None) -> Models:
    fmt = next((f for f in checkpoint_formats() if f.detect(Path(model))), None)
    if fmt is None:
        ckpt = open_checkpoint(model)
        return Models(WeightBank(ckpt), ckpt, None, None)
    q = fmt.open(Path(model))
    float_ckpt = open_checkpoint(_float_dir(Path(mamba_model_path), Path(model).name)) if mamba_model_path else None
    if float_ckpt is not None:
        fd, qd = asdict(float_ckpt.dims), asdict(q.dims)
        diff = [f"{k} {fd.get(k)} vs {qd.get(k)}" for k in _DIMS + _DIMS2 if (k in fd or k in qd) and fd.get(k) != qd.get(k)]
        if float_ckpt.dims.vocab_size > q.dims.vocab_size:
            diff.append(f"vocab {float_ckpt.dims.vocab_size} vs {q.dims.vocab_size}")
        if diff:
            raise ModelDirError(f"--mamba_model_path {float_ckpt.path} does not belong to {model}: "
                                f"{', '.join(diff)} (float vs quantized)")
        if hasattr(q, "attach_float"):  # Quamba2: the channel and head order comes from the float model
            q.attach_float(float_ckpt)
    return Models(WeightBank(float_ckpt, given=q), q, float_ckpt, q, fmt)


def needs_float(recipe, prep: str = "quamba", given=None) -> bool:
    """True when a recipe cannot run from a quantized checkpoint alone (it holds the rotated codes of its prep:
    Quamba1's prep=quamba, Quamba2's prep=quamba2; given, the checkpoint: its weights, int8 or Quamba2's W4
    int4, and the calibration key of its scales)."""
    weights, key = getattr(given, "weights", "int8"), getattr(given, "calibration_key", None)
    # the family's key (a family may read another calibration than its knobs' key: q2-w4ax, recipes.quamba.w4ax)
    return recipe.weights != Weights(weights) or recipe.rotate != Rotate.YES or recipe.prep != Prep(prep) or \
        (key is not None and recipe_for(recipe).calibration_key(recipe) != key)


def check_pair(models: Models, depth: int) -> dict:
    """How well the quantized checkpoint and its float model belong together (the format's own check)."""
    return models.format.check_pair(models, depth)


def checkpoint_calibration(q, depth: int) -> CalibrationResult:
    scales = [q.layer_scales(i) for i in range(depth + 1)]
    prep = getattr(q, "prep", "quamba")
    return CalibrationResult(scales, {"source": "checkpoint", "path": str(q.path),
                                      "prep": getattr(q, "calibration_key", prep),
                                      "scales": [s.info() if hasattr(s, "info") else s.as_dict() for s in scales],
                                      "seconds": 0.0})
