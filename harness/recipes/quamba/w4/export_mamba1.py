"""``python -m harness export --recipe w4a8|w4a16`` of a Mamba-1 model: a ``W4A8QMamba`` / ``W4A16QMamba`` checkpoint.

enyac-group/Quamba c474646. The int4 weights are the q2-w4a8 / q2-w4a16 mode's (recipes.quamba.w4.calibrate_mamba1: GPTQ's in_proj
and out_proj, its cache shared with capture; x_proj Marlin's round to nearest), packed as Marlin-QQQ / Marlin
(kernels.marlin; in_proj's and x_proj's channel scales carry their output scale, as ``w4a8_quantize(
out_scales=)`` fuses it, marlin_utils.py:254-256; out-features padded to 64 / 256, qLinearLayer.py:24-26, 289-291).
W4A8's other tensors are mode 0's (``W4A8QMamba.from_fp16`` builds W8A8QMamba's QCausalConv1D, dt_proj, QSScan and
QHadamard from the same scales, qMambaLayer.py:593-645; recipes.quamba.checkpoint's writer without its int8 in_proj,
x_proj, out_proj), with ``input_scale`` s_in, s_u and s_H on the Marlin-QQQ linears. W4A16 keeps the prepared fp16
model's conv1d ([E, 1, K]), dt_proj weight, dt_proj_bias (fp32, as MambaSimple holds it, qMambaLayer.py:63), A_log
and D (:345-368) and the block norm (folded: ones). The embedding and lm_head are the mode's own fp16 ones
(``Embedding``, ``Linear``). Reading the export back (recipes.quamba.w4.checkpoint_mamba1) gives the mode's arrays bit for bit.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import replace

import torch

from ..families import calibrate_key
from .export_mamba2 import marlin_entries
from ....runner.forwards import build_head
from ....runner.weightbank import WeightBank
from ..checkpoint import PAD_VOCAB, layer_entries, pad_rows
from .block_mamba1 import Q1W4Layer
from ....architectures.mamba1.weights import LayerParams
from ...registry import get_mode, on_architecture
from ....spec import ModelDims, QTensor

__all__ = ["export_m1w4_files", "m1w4_block_state_dict"]

_LINEARS = ("in_proj.", "x_proj.", "out_proj.")


def m1w4_block_state_dict(i: int, p: LayerParams, w4: Q1W4Layer, dims: ModelDims) -> dict:
    """Block i's entries of a W4A8QMamba (w4.scales given; p: mode 0's int8 LayerParams) or W4A16QMamba checkpoint
    (p: the prep=quamba fp16 LayerParams), module docstring."""
    k, m = f"backbone.layers.{i}.", f"backbone.layers.{i}.mixer."
    s = w4.scales
    if s is not None:
        zero = QTensor(torch.zeros(1, 1, dtype=torch.int8), 1.0)  # the int8 linears' entries are dropped below
        base = layer_entries(i, replace(p, in_proj=zero, x_proj=zero, out_proj=zero), s, dims)
        sd = {key: v for key, v in base.items() if not key.startswith(tuple(m + n for n in _LINEARS))}
    else:
        h = lambda t: t.to(torch.float16).contiguous()  # noqa: E731  (fp16 values already)
        norm = torch.ones(dims.d_model) if p.norm_weight is None else p.norm_weight
        sd = {k + "norm.weight": h(norm), m + "conv1d.weight": h(p.conv_weight)[:, None].contiguous(),
              m + "dt_proj.weight": h(p.dt_proj), m + "dt_proj_bias": p.dt_bias.to(torch.float32).contiguous(),
              m + "A_log": p.A_log.to(torch.float32).contiguous(), m + "D": p.D.to(torch.float32).contiguous()}
        if p.conv_bias is not None:
            sd[m + "conv1d.bias"] = h(p.conv_bias)
    ins = (None, None, None) if s is None else (s.s_in, s.s_u, s.s_H)  # in_proj, x_proj, out_proj:input
    for name, w, s_in in zip(("in_proj", "x_proj", "out_proj"), (w4.in_proj, w4.x_proj, w4.out_proj), ins):
        sd.update(marlin_entries(m + name, w, s_in))
    return sd


def export_m1w4_files(cfg, ckpt, windows: torch.Tensor, tmp, emit, progress, config: dict) -> None:
    """Mode 0's calibration (W4A8) and GPTQ of every block of the Mamba-1 `ckpt`; the checkpoint into the new
    directory `tmp`. cfg: runner.export.ExportConfig (recipe w4a8 or w4a16); config: its config.json (W8A8's,
    runner.export._config), the mixer and norm classes set here (modelutils_mamba.py:863-866)."""
    dims, depth = ckpt.dims, ckpt.dims.n_layer - 1
    mode = on_architecture(get_mode(f"q2-{cfg.recipe}"), "mamba1")
    bank = WeightBank(ckpt)
    result = calibrate_key(bank, windows, cfg.calib, depth,
                           ckpt.prefix_hashes(depth), cfg.cache_dir, mode.calibration_key, progress=progress)
    emit(f"calibration: {result.info['source']} ({cfg.calib.num_samples} samples x {cfg.calib.seqlen} tokens, "
         f"layers 0..{depth}, {result.info['seconds']} s)")
    sd: OrderedDict = OrderedDict()
    vocab = dims.vocab_size
    rows = vocab + (PAD_VOCAB - vocab % PAD_VOCAB) % PAD_VOCAB
    table = bank.embed(torch.arange(vocab)[None], True, torch.float16, mode.prep, mode.weights)[0].to(torch.float16)
    sd["backbone.embedding.weight"] = pad_rows(table, rows)
    with progress.stage("packing the weights", dims.n_layer, "layers"):
        for i, w4 in enumerate(result.scales):
            p = bank.layer(i, "int8" if w4.scales is not None else "fp16", True, "quamba")
            sd.update(m1w4_block_state_dict(i, p, w4, dims))
            bank.release(i)
            progress.advance()
    sd["backbone.norm_f.weight"] = torch.ones(dims.d_model, dtype=torch.float16)  # folded (modelutils_mamba.py:69)
    sd["lm_head.weight"] = pad_rows(build_head(mode, bank).weight.to(torch.float16), rows)  # the mode's fp16 head
    config["ssm_cfg"]["layer"] = "W4A8QMamba" if cfg.recipe == "w4a8" else "W4A16QMamba"
    config["norm_cfg"] = {"norm": "QRMSNorm" if cfg.recipe == "w4a8" else "RMSNorm"}  # modelutils_mamba.py:516-572
    torch.save(sd, tmp / "pytorch_model.bin")
    (tmp / "config.json").write_text(json.dumps(config, indent=4))
