"""Quamba's exports (``python -m harness export --recipe w8a8|w4a8|w4a16``, runner.export): a Quamba1 W8A8
checkpoint of a Mamba-1 model (here), Quamba2's W8A8 of a Mamba-2 model (q2/export.py), and Quamba2's W4A8 and
W4A16 of either (w4/export_mamba1.py, w4/export_mamba2.py), registered as the registry's exporters.

The weights are prepared and quantized by the code the built-in int8 modes run
(``WeightBank.layer(i, "int8", True, "quamba")``, ``WeightBank.embed``), the scales come from the same
calibration (and cache) as a capture, and ``checkpoint.write_quamba`` lays them out as
``QuambaLMHeadModel.save_pretrained`` does. So capturing from the export gives the arrays of
capturing from the float model, bit for bit, whatever the weight preparation is.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from ...emulation.modules import EmuRMSNorm
from ...kernels.quant import quantize_rows_signed_max_fp16, quantize_weight_fp16
from ...modes import CALIBRATION_RECIPES
from ...runner.backbone import build_backbone
from ...runner.weightbank import WeightBank, lm_head_weight
from ...spec import FloatOut
from ..registry import Exporter, register_exporter
from .calibration import calibrate
from .checkpoint import PAD_VOCAB, pad_rows, write_quamba
from .observers import MinMaxObserver
from .q2.export import check_q2_export, export_q2_files
from .w4.export_mamba1 import export_m1w4_files
from .w4.export_mamba2 import check_q2w4_export, export_q2w4_files

__all__ = ["export_w8a8_files", "register_exporters", "W4_RECIPES"]

W4_RECIPES = ("w4a8", "w4a16")
_MAMBA1, _MAMBA2 = "mamba1", "mamba2"


def _lm_head_input_scale(bank: WeightBank, windows: torch.Tensor, batch_size: int, depth: int,
                         step: Callable[[], None] = lambda: None) -> float:
    """Min-max scale of lm_head's input (modelutils_mamba.py:182-189): the final norm's fp16 output of the
    calibration model (weight 1: folded into lm_head) over the calibration windows."""
    model = build_backbone(CALIBRATION_RECIPES["quamba"], bank, None, depth, calibration=True)
    norm = EmuRMSNorm(None, bank.dims.norm_eps, FloatOut(torch.float16))
    observer = MinMaxObserver()
    for batch in windows.split(batch_size):
        observer.observe(norm(model(batch)))
        step()
    return observer.compute_scale()


def _config(dims, vocab: int, embedding_layer: str, lm_head_layer: str) -> dict:
    """mamba_ssm MambaConfig.__dict__ with Quamba's additions (modelutils_mamba.py:863-870)."""
    ssm = {"d_state": dims.d_state, "d_conv": dims.d_conv, "expand": dims.d_inner // dims.d_model}
    if dims.dt_rank != -(-dims.d_model // 16):
        ssm["dt_rank"] = dims.dt_rank
    ssm["layer"] = "W8A8QMamba"
    return {"d_model": dims.d_model, "d_intermediate": 0, "n_layer": dims.n_layer, "vocab_size": vocab,
            "ssm_cfg": ssm, "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True, "residual_in_fp32": True,
            "fused_add_norm": True, "pad_vocab_size_multiple": PAD_VOCAB, "tie_embeddings": False,
            "norm_cfg": {"norm": "QRMSNorm"}, "embedding_cfg": {"layer": embedding_layer},
            "lm_head_cfg": {"layer": lm_head_layer}}


def export_w8a8_files(cfg, ckpt, windows: torch.Tensor, tmp: Path, emit, progress) -> None:
    """Quamba1's W8A8 of the Mamba-1 `ckpt`: calibrate every block, write the checkpoint into the new directory
    `tmp`. cfg: runner.export.ExportConfig."""
    dims, depth = ckpt.dims, ckpt.dims.n_layer - 1
    bank = WeightBank(ckpt)
    result = calibrate(bank, windows, cfg.calib, depth, ckpt.prefix_hashes(depth), cfg.cache_dir, "quamba",
                       progress=progress)
    emit(f"calibration: {result.info['source']} ({cfg.calib.num_samples} samples x {cfg.calib.seqlen} tokens, "
         f"layers 0..{depth}, {result.info['seconds']} s)")
    lm_scale = None
    if cfg.quantize_lm_head:
        with progress.stage("calibrating lm_head's input", -(-windows.shape[0] // cfg.calib.batch_size),
                            "batches"):
            lm_scale = _lm_head_input_scale(bank, windows, cfg.calib.batch_size, depth, progress.advance)
    layers = []
    with progress.stage("quantizing the weights", dims.n_layer, "layers"):
        for i in range(dims.n_layer):
            layers.append(bank.layer(i, "int8", True, "quamba"))
            bank.release(i)  # keep only the int8 codes of the blocks already done
            progress.advance()
    vocab = dims.vocab_size
    rows = vocab + (PAD_VOCAB - vocab % PAD_VOCAB) % PAD_VOCAB
    # the rotated fp16 rows the int8 modes embed with (Quamba1: fp16, not quantized)
    table = bank.embed(torch.arange(vocab)[None], True, torch.float16, "quamba", "int8")[0].to(torch.float16)
    table = pad_rows(table, rows)
    if cfg.quantize_embedding:
        codes, scales = quantize_rows_signed_max_fp16(table)
        embedding = {"backbone.embedding.weight": codes, "backbone.embedding.scales": scales}
    else:
        embedding = {"backbone.embedding.weight": table}
    lm_head = pad_rows(lm_head_weight(ckpt).to(torch.float16), rows)
    if cfg.quantize_lm_head:  # W8A8B16O16Linear.from_fp16 (qLinearLayer.py:771-785)
        lm_head = quantize_weight_fp16(lm_head)
    config = _config(dims, vocab, "W8O16Embedding" if cfg.quantize_embedding else "Embedding",
                     "W8A8B16O16Linear" if cfg.quantize_lm_head else "Linear")
    write_quamba(tmp, dims, config, layers, result.scales, embedding=embedding, lm_head=lm_head,
                 lm_head_input_scale=lm_scale)


def _export_m1w4(cfg, ckpt, windows: torch.Tensor, tmp: Path, emit, progress) -> None:
    """Quamba2's W4A8QMamba / W4A16QMamba of a Mamba-1 model, its config.json W8A8's with the mixer set there."""
    export_m1w4_files(cfg, ckpt, windows, tmp, emit, progress, _config(ckpt.dims, ckpt.dims.vocab_size, "Embedding",
                                                                        "Linear"))


def _check_q2(cfg, dims) -> str | None:
    problem = check_q2_export(dims, cfg.recipe)
    return f"--model {cfg.model}: {problem}" if problem else None


def _check_w4(cfg, dims) -> str | None:
    problem = check_q2w4_export(dims, cfg.quantize_embedding, cfg.quantize_lm_head)
    return f"--model {cfg.model} --recipe {cfg.recipe}: {problem}" if problem else None


def _check_q2w4(cfg, dims) -> str | None:
    return _check_q2(cfg, dims) or _check_w4(cfg, dims)


def _summary(out: Path) -> str:
    return (f"wrote {out}: config.json, pytorch_model.bin ({(out / 'pytorch_model.bin').stat().st_size} bytes)"
            f" and the tokenizer files")


def register_exporters() -> None:
    """w8a8 (Quamba1 on Mamba-1, Quamba2 on Mamba-2), w4a8 and w4a16 (Quamba2's, on both)."""
    register_exporter(Exporter("w8a8", _MAMBA1, export_w8a8_files, None, _summary))
    register_exporter(Exporter("w8a8", _MAMBA2, export_q2_files, _check_q2, _summary))
    for name in W4_RECIPES:
        register_exporter(Exporter(name, _MAMBA1, _export_m1w4, _check_w4, _summary))
        register_exporter(Exporter(name, _MAMBA2, export_q2w4_files, _check_q2w4, _summary))
