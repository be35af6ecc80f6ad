"""Whether a Quamba checkpoint and a float model belong together: the fraction of the checkpoint's weight codes that the
float model, prepared and quantized as the built-in int8 modes do (``WeightBank.layer(i, "int8", True, "quamba")``),
reproduces within one code; below ``PAIR_MIN_FRACTION`` the run warns that the pair is probably mismatched.
"""
from __future__ import annotations

import torch

from ...architectures.mamba1.weights import int8_layer
from ...checkpoints.loading import ModelDirError
from ...kernels.int4 import rtn_int4
from ...runner.weightbank import WeightBank

__all__ = ["check_pair", "PAIR_MIN_FRACTION"]

PAIR_MIN_FRACTION = 0.99


def check_pair(models, depth: int) -> dict:
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


def _w8a8_pairs(models, float_bank: WeightBank, i: int) -> dict:
    mine = models.bank.layer(i, "int8", True, "quamba")
    ours = float_bank.layer(i, "int8", True, "quamba")  # the same preparation as the built-in int8 modes
    return {n: (getattr(mine, n).codes, getattr(ours, n).codes) for n in _FIELDS
            if getattr(mine, n) is not None and getattr(ours, n) is not None}


def _m1w4_pairs(models, float_bank: WeightBank, i: int) -> dict:
    """A W4A8QMamba / W4A16QMamba checkpoint (recipes.quamba.w4.checkpoint_mamba1): x_proj's int4 codes against Marlin's round to
    nearest of the float model's prepared fp16 weight (kernels.int4; GPTQ's in_proj and out_proj depend on the
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


def _check_pair_q2(models, depth: int) -> dict:
    q = models.quamba
    for i in range(depth + 1):
        q.reorder(i)
    per_layer = {f"L{i}": q.order_summary.get(i) for i in range(depth + 1)}
    fraction = min((min(v.values()) for v in per_layer.values() if v), default=1.0)
    return {"float_model": str(models.float_ckpt.path), "layers": list(range(depth + 1)),
            "within_one_code": fraction, "identical": fraction, "per_tensor": per_layer,
            "order": "channel and head order recovered by matching in_proj rows (recipes.quamba.q2.order)",
            "matched": fraction >= PAIR_MIN_FRACTION}


