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

import torch

from .calibration import CalibrationResult
from ..runtime.log import warn
from ..modes import Prep, Rotate, Weights
from ..checkpoints.loading import Checkpoint, ModelDirError, Tokenizer, load_tokenizer, open_checkpoint, refuse_in
from ..checkpoints.quamba import QuambaCheckpoint, is_quamba_dir
from ..checkpoints.quamba2 import open_any_quamba
from ..store.files import is_regular
from .weightbank import WeightBank
from ..kernels.marlin_rtn import rtn_int4
from ..emulation.weights import int8_layer

__all__ = ["Models", "open_models", "check_pair", "checkpoint_calibration", "needs_float", "PAIR_MIN_FRACTION"]

PAIR_MIN_FRACTION = 0.99
_DIMS = ("d_model", "d_inner", "d_state", "d_conv", "dt_rank", "n_layer")
_DIMS2 = ("ngroups", "headdim", "nheads", "chunk_size")  # Mamba-2 (a Quamba2 checkpoint)


@dataclass
class Models:
    bank: WeightBank
    primary: Checkpoint | QuambaCheckpoint   # the --model directory
    float_ckpt: Checkpoint | None
    quamba: QuambaCheckpoint | None

    @property
    def tokenizer_dirs(self) -> list[Path]:
        return [self.primary.path] + ([self.float_ckpt.path] if self.quamba and self.float_ckpt else [])

    def gives_scales(self, key: str) -> bool:
        """A Quamba checkpoint holds the scales (and codes) of one calibration key (prep=quamba, quamba2, or
        Quamba2's W4 "quamba2-w4a8"/"quamba2-w4a16"): no calibration for those."""
        return self.quamba is not None and key == getattr(self.quamba, "calibration_key", self.quamba.prep)

    def needs_calibration(self, recipes) -> bool:
        """Whether some recipe needs scales that must be calibrated (so the calibration text is read)."""
        return any(r.needs_calibration and not self.gives_scales(r.calibration_key) for r in recipes)

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
    if not is_quamba_dir(model):
        ckpt = open_checkpoint(model)
        return Models(WeightBank(ckpt), ckpt, None, None)
    q = open_any_quamba(model)
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
    return Models(WeightBank(float_ckpt, given=q), q, float_ckpt, q)


def needs_float(recipe, prep: str = "quamba", given=None) -> bool:
    """True when a recipe cannot run from a quantized checkpoint alone (it holds the rotated codes of its prep:
    Quamba1's prep=quamba, Quamba2's prep=quamba2; given, the checkpoint: its weights, int8 or Quamba2's W4
    int4, and the calibration key of its scales)."""
    weights, key = getattr(given, "weights", "int8"), getattr(given, "calibration_key", None)
    return recipe.weights != Weights(weights) or recipe.rotate != Rotate.YES or recipe.prep != Prep(prep) or \
        (key is not None and recipe.calibration_key != key)


def check_pair(models: Models, depth: int) -> dict:
    """Fraction of the checkpoint's weight codes (blocks 0..depth) within one code of the float model's; for a
    Quamba2 checkpoint, the fraction of its channels and heads whose in_proj rows match the float model's exactly;
    for a Quamba2 W4 checkpoint of a Mamba-1 model, the codes _m1w4_pairs compares."""
    if hasattr(models.quamba, "attach_float"):
        return _check_pair_q2(models, depth)
    pairs = _m1w4_pairs if getattr(models.quamba, "weights", "int8") == "int4" else _w8a8_pairs
    within = total = exact = 0
    per_tensor = {}
    float_bank = WeightBank(models.float_ckpt)
    for i in range(depth + 1):
        for name, (a, b) in pairs(models, float_bank, i).items():
            if a.shape != b.shape:
                raise ModelDirError(f"layer {i} {name}: the checkpoint has shape {list(a.shape)}, "
                                    f"the float model {list(b.shape)}")
            if a.is_floating_point():  # fp16 values (W4A16): equal or not
                d = (a != b).to(torch.int16) * 2
            else:
                d = (a.to(torch.int16) - b.to(torch.int16)).abs()
            n_within, n = int((d <= 1).sum()), d.numel()
            within, total, exact = within + n_within, total + n, exact + int((d == 0).sum())
            per_tensor[f"L{i}.{name}"] = round(n_within / n, 6)
    fraction = within / total if total else 1.0
    return {"float_model": str(models.float_ckpt.path), "layers": list(range(depth + 1)), "codes": total,
            "within_one_code": round(fraction, 6), "identical": round(exact / total if total else 1.0, 6),
            "per_tensor": per_tensor, "matched": fraction >= PAIR_MIN_FRACTION}


_FIELDS = ("in_proj", "conv_weight", "conv_bias", "x_proj", "dt_proj", "dt_bias", "A_log", "D", "out_proj")


def _w8a8_pairs(models: Models, float_bank: WeightBank, i: int) -> dict:
    mine = models.bank.layer(i, "int8", True, "quamba")
    ours = float_bank.layer(i, "int8", True, "quamba")  # the same preparation as the built-in int8 modes
    return {n: (getattr(mine, n).codes, getattr(ours, n).codes) for n in _FIELDS
            if getattr(mine, n) is not None and getattr(ours, n) is not None}


def _m1w4_pairs(models: Models, float_bank: WeightBank, i: int) -> dict:
    """A W4A8QMamba / W4A16QMamba checkpoint (checkpoints.quamba1_w4): x_proj's int4 codes against Marlin's round to
    nearest of the float model's prepared fp16 weight (ops.marlin_rtn; GPTQ's in_proj and out_proj depend on the
    calibration text and are not compared); W4A8 the int8 conv, dt_proj and scan codes against mode 0's, W4A16 the
    fp16 conv, dt_proj and scan tensors against the prepared fp16 ones."""
    q = models.quamba
    w4a8 = q.recipe == "W4A8"
    fp16 = float_bank.layer(i, "fp16", True, "quamba")
    ours, mine = (int8_layer(fp16) if w4a8 else fp16), q.q2_params(i)
    out = {"x_proj": (q.layer_scales(i).x_proj.codes, rtn_int4(fp16.x_proj, w4a8).codes)}
    for n in _FIELDS[1:3] + _FIELDS[4:8]:
        a, b = getattr(mine, n), getattr(ours, n)
        if a is not None and b is not None:
            out[n] = (a.codes, b.codes) if w4a8 else (a, b)
    return out


def _check_pair_q2(models: Models, depth: int) -> dict:
    q = models.quamba
    for i in range(depth + 1):
        q.reorder(i)
    per_layer = {f"L{i}": q.order_summary.get(i) for i in range(depth + 1)}
    fraction = min((min(v.values()) for v in per_layer.values() if v), default=1.0)
    return {"float_model": str(models.float_ckpt.path), "layers": list(range(depth + 1)),
            "within_one_code": fraction, "identical": fraction, "per_tensor": per_layer,
            "order": "channel and head order recovered by matching in_proj rows (checkpoints.quamba2_order)",
            "matched": fraction >= PAIR_MIN_FRACTION}


def checkpoint_calibration(q: QuambaCheckpoint, depth: int) -> CalibrationResult:
    scales = [q.layer_scales(i) for i in range(depth + 1)]
    prep = getattr(q, "prep", "quamba")
    return CalibrationResult(scales, {"source": "checkpoint", "path": str(q.path),
                                      "prep": getattr(q, "calibration_key", prep),
                                      "scales": [s.info() if hasattr(s, "info") else s.as_dict() for s in scales],
                                      "seconds": 0.0})
