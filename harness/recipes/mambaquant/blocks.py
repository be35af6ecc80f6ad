"""MambaQuant's W8A8 / W4A8 blocks of Mamba-1 (docs/field-recipes.md "MambaQuant"; the notes §4), the flag set of
the release's launch config (MambaQuant/MambaQuant@a4803c4 .vscode/launch.json:190-243): S2, S3, S4, S5 and the
rotations R1, R2, R3, R5, R6 with KLT, in the code's order (model_llm/tests/quant_naive.py:588-713). Each rotation
is an orthogonal matrix (KLT K, the covariance eigenvectors, times a seeded random-sign Hadamard H; K = I where the
code has none); activations are rotated online, weights absorb the inverse:

====  ============================  ==================================================  =================
site  rotation                      weights                                             online
====  ============================  ==================================================  =================
S2    s from out_proj's input       in_proj z rows / s, out_proj columns * s            gate x*sig(s*x)
S3    quantile |h| per d_inner      --                                                  h / S3 ... y * S3
S4    quantile |C| per d_state      x_proj C rows * s4, B rows / s4                     --
S5    s from dt_proj's input        x_proj dt rows / s, dt_proj columns * s              --
R1    K(layer 0 in_proj input) H    norm folded; in_proj W @ R1; out_proj R1^T @ W      x @ R1 (and back)
R2    K(out_proj input) H           out_proj W @ R2                                     y @ R2
R3    H                             --                                                  h along d_inner
R5    K(dt_proj input) H            x_proj dt rows R5 @ W; dt_proj W @ R5^T              --
R6    H                             x_proj W @ R6                                       u @ R6 (x_proj's)
====  ============================  ==================================================  =================

The residual stream stays in the model's basis between blocks (R1 applied at in_proj's input and undone at
out_proj's output: the same numbers, since MambaQuant quantizes neither the residual nor the norm).

``upstream``: "as-meant" (default) or "as-written", the release's defects (the notes §4d): R2 takes the *last*
layer's KLT for every layer (stale index i, quant_naive.py:676-678) and R2 and R5 accumulate across layers
(:679, :700), every rotation is rounded to fp16 (:646-651), and weights are quantized before the transforms (a
first run without cached statistics: set_quant_state at :499 precedes the calibration forwards).
"""
from __future__ import annotations

import torch

from ...architectures.registry import get_architecture
from ...kernels.fakequant import fq_asym_rows, fq_sym, fq_sym_dynamic, percentile_clip_rows
from ...kernels.field_transforms import klt, random_hadamard, smooth_factors
from ...emulation.fakequant import AmaxObserver, wrap_mamba1
from .scan import MQScan

__all__ = ["rotations", "build", "MQ_POINTS", "weight_rtn", "fold_layer", "observers_for", "setup_layer", "LINEARS",
           "act_quantizer"]

MQ_POINTS = ("in_proj", "conv", "x_proj", "dt_proj", "out_proj", "h", "C")
_F64 = torch.float64
_PERCENT = 0.999999  # the weight observer's percentile (quantizer.py:113-116)


def _fp16(r: torch.Tensor) -> torch.Tensor:
    return r.to(torch.float16).to(_F64)


def rotations(stats: list[dict], layer: int, dims, seed: int, as_written: bool) -> dict[str, torch.Tensor]:
    """R1, R2, R3, R5, R6 of one layer (float64), drawn from the seed in the code's order R1..R6. As written every
    factor and every product is rounded to fp16 as the release's fp16 tensors are (quant_naive.py:646-705)."""
    H = {k: random_hadamard(n, seed * 16 + k) for k, n in
         ((1, dims.d_model), (2, dims.d_inner), (3, dims.d_inner), (5, dims.dt_rank), (6, dims.d_inner))}
    if not as_written:
        return {"R1": klt(stats[0]["cov_in"]) @ H[1], "R2": klt(stats[layer]["cov_out"]) @ H[2], "R3": H[3],
                "R5": klt(stats[layer]["cov_dt"]) @ H[5], "R6": H[6]}
    H = {k: _fp16(v) for k, v in H.items()}
    k_last, r2, r5 = _fp16(klt(stats[-1]["cov_out"])), H[2], H[5]
    for j in range(layer + 1):  # R2 = K @ R2 with the stale i = last layer; R5 = (K_j @ R5): both accumulate
        r2 = _fp16(k_last @ r2)
        r5 = _fp16(_fp16(klt(stats[j]["cov_dt"])) @ r5)
    return {"R1": _fp16(_fp16(klt(stats[0]["cov_in"])) @ H[1]), "R2": r2, "R3": H[3], "R5": r5, "R6": H[6]}


def fold_layer(p, st: dict, rot: dict, dims) -> dict[str, torch.Tensor]:
    """The layer's weights with every transform folded in (float64 -> fp32), from LayerParams p."""
    E, R, N = dims.d_inner, dims.dt_rank, dims.d_state
    s2 = smooth_factors(st["amax_out"], p.out_proj, 0.5, 1e-2).to(_F64)
    s5 = smooth_factors(st["amax_dt"], p.dt_proj, 0.5, 1e-2).to(_F64)
    s4 = st["s4"].to(_F64)
    w_in = p.in_proj.to(_F64) * p.norm_weight.to(_F64)[None, :]
    w_in = torch.cat([w_in[:E], w_in[E:] / s2[:, None]]) @ rot["R1"]
    wx = p.x_proj.to(_F64)
    w_dt, w_b, w_c = wx[:R] / s5[:, None], wx[R:R + N] / s4[:, None], wx[R + N:] * s4[:, None]
    wx = torch.cat([rot["R5"] @ w_dt, w_b, w_c]) @ rot["R6"]
    w_dtp = (p.dt_proj.to(_F64) * s5[None, :]) @ rot["R5"].T
    w_out = rot["R1"].T @ (p.out_proj.to(_F64) * s2[None, :]) @ rot["R2"]
    f = lambda t: t.to(torch.float32)  # noqa: E731
    return {"in_proj": f(w_in), "x_proj": f(wx), "dt_proj": f(w_dtp), "out_proj": f(w_out), "s2": f(s2)}


def weight_rtn(w: torch.Tensor, bits: int, quantizer: str) -> torch.Tensor:
    """MambaQuant's weights: per output row asymmetric, clipped at the 0.999999 percentile; Quamba's: per tensor
    symmetric absmax."""
    if quantizer == "quamba":
        return fq_sym_dynamic(w, bits)
    lo, hi = percentile_clip_rows(w, _PERCENT)
    return fq_asym_rows(w, bits, lo, hi)


def act_quantizer(quantizer: str, scales: dict | None, name: str, observers: dict | None):
    if observers is not None:
        return observers[name]
    if quantizer == "none":
        return lambda x: x
    if quantizer == "quamba":
        return lambda x, s=scales[name]: fq_sym(x, s)
    return lambda x: fq_asym_rows(x, 8)  # dynamic per sequence (quantizer.py:273-285)


def _params_as_written(p, bits: int, quantizer: str):
    """Weights quantized before any transform (the release's first run; the norm is folded afterwards)."""
    from dataclasses import replace
    q = {n: weight_rtn(getattr(p, n), bits, quantizer) for n in ("in_proj", "x_proj", "dt_proj", "out_proj")}
    return replace(p, **q)


def build(mode, bank, stats: list[dict], depth: int, opts: dict, *, scales: list | None = None,
          observers: list | None = None) -> list:
    """Blocks 0..depth. opts: bits, quantizer ("mambaquant", "quamba", "none"), upstream, seed; scales: Quamba's
    static per-tensor scales per layer (quantizer "quamba"); observers: per layer a function per point (the
    calibration models: transforms on, the observers in place of the activation quantizers). With 4 bits the
    linear weights are the GPTQ'd ones of the statistics (``gptq_<name>``, recipes.mambaquant.gptq)."""
    blocks = get_architecture("mamba1").build_blocks(mode, bank, None, depth, False)
    for i, block in enumerate(blocks):
        setup_layer(block, bank, stats, i, opts, scale=scales[i] if scales else None,
                    observer=observers[i] if observers else None)
    return blocks


LINEARS = ("in_proj", "x_proj", "dt_proj", "out_proj")


def setup_layer(block, bank, stats: list[dict], i: int, opts: dict, *, scale: dict | None = None,
                observer: dict | None = None, weights: dict | None = None) -> None:
    """Block i of the float model made MambaQuant's (in place); weights: the linear weights to use as they are."""
    dims, quantizer, bits = bank.dims, opts["quantizer"], opts["bits"]
    as_written = opts["upstream"] == "as-written"
    quantize_w = quantizer != "none" and observer is None
    p = bank.layer(i, "fp32", False, "exact")
    rot = rotations(stats, i, dims, opts["seed"], as_written)
    early = as_written and quantize_w and weights is None
    w = fold_layer(_params_as_written(p, bits, quantizer) if early else p, stats[i], rot, dims)
    if weights is None and bits == 4 and quantize_w and quantizer == "mambaquant":
        weights = {n: stats[i][f"gptq_{n}"] for n in LINEARS}
    for name in LINEARS:
        if weights is not None:
            getattr(block, name).weight = weights[name]
        else:
            getattr(block, name).weight = weight_rtn(w[name], bits, quantizer) if quantize_w and not early else w[name]
    if quantize_w:
        block.conv1d.weight = weight_rtn(block.conv1d.weight, bits, quantizer)
    block.norm.weight = None
    r = {k: v.to(torch.float32) for k, v in rot.items()}
    q = {n: observer[n] if observer is not None else act_quantizer(quantizer, scale, n, None) for n in MQ_POINTS}
    s = block.ssm
    block.ssm = MQScan(s.A_log, s.D, s.dt_bias, gate_s=w["s2"], R3=r["R3"], S3=stats[i]["s3"],
                       quant_h=q["h"], quant_c=q["C"])
    wrap_mamba1(block, {"in_proj.in": lambda x, R=r["R1"], f=q["in_proj"]: f(x @ R), "conv.in": q["conv"],
                        "x_proj.in": lambda x, R=r["R6"], f=q["x_proj"]: f(x @ R), "dt_proj.in": q["dt_proj"],
                        "out_proj.in": lambda x, R=r["R2"], f=q["out_proj"]: f(x @ R),
                        "out_proj.out": lambda x, R=r["R1"]: x @ R.T})
    block.folded = w  # the transformed fp weights (GPTQ starts from them)


def observers_for(depth: int) -> list[dict]:
    return [{n: AmaxObserver() for n in MQ_POINTS} for _ in range(depth + 1)]
