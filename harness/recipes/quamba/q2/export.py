"""``python -m harness export`` of a Mamba-2 model: Quamba2's W8A8 recipe, written as a ``W8A8QMamba2`` checkpoint.

The scales and groups come from the q2-w8a8 mode's calibration (and its cache, recipes.quamba.q2.calibrate), the
weights from the code the mode runs (recipes.quamba.q2.params.q2_params), the embedding rows and the lm_head from the
mode's own (WeightBank.embed, head.build_head); recipes.quamba.q2.checkpoint lays them out as
``QuambaLMHeadModel.save_pretrained`` does (enyac-group/Quamba c474646 quamba/modelutils_mamba.py:853-873). So
capturing q2-w8a8 from the export (with the float model for the channel order) gives the arrays of capturing it
from the float model, bit for bit. The SSM state scales of the decode step come from the same calibration; with
--quantize_lm_head one more pass over the calibration windows observes lm_head's input scale
(recipes.quamba.q2.lm_head_scale).
"""
from __future__ import annotations

import torch

from ..families import calibrate_key
from ....runner.forwards import build_head
from ....runner.weightbank import WeightBank
from ..checkpoint import PAD_VOCAB, pad_rows
from .checkpoint import q2_state_dict, write_quamba2
from .calibration import q2_grouping_problem
from .params import q2_params
from .lm_head_scale import q2_lm_head_scale
from ....kernels.quant import quantize_rows_signed_max_fp16, quantize_weight_fp16
from ....modes import Q2_CALIBRATION_RECIPE
from ...registry import get_mode
from ....spec import Mamba2Dims

__all__ = ["Q2_RECIPES", "check_q2_export", "q2_config", "export_q2_files"]

Q2_RECIPES = ("w8a8", "w4a8", "w4a16")  # Quamba2's (utils.py:58-110, eval.sh:31-41); w4a8/w4a16: recipes.quamba.w4.export_mamba2


def check_q2_export(dims: Mamba2Dims, recipe: str) -> str | None:
    """Why this model or recipe cannot be exported as a Quamba2 checkpoint, or None."""
    if recipe not in Q2_RECIPES:
        return f"--recipe {recipe}: valid: {', '.join(Q2_RECIPES)}"
    if dims.norm_eps != 1e-5:
        return (f"the model's norm epsilon is {dims.norm_eps}; Quamba's config has no field for it and builds "
                f"1e-5 (mamba_ssm create_block's default), so the checkpoint would not compute this model")
    return q2_grouping_problem(dims)  # the check a run makes before any work (families.Quamba2.model_problem)


def q2_config(dims: Mamba2Dims, vocab: int, embedding_layer: str, lm_head_layer: str) -> dict:
    """mamba_ssm MambaConfig.__dict__ of a Mamba-2 model with Quamba's additions (modelutils_mamba.py:863-872)."""
    ssm = {"d_state": dims.d_state, "d_conv": dims.d_conv, "expand": dims.d_inner // dims.d_model,
           "headdim": dims.headdim, "ngroups": dims.ngroups, "chunk_size": dims.chunk_size, "layer": "W8A8QMamba2"}
    return {"d_model": dims.d_model, "d_intermediate": 0, "n_layer": dims.n_layer, "vocab_size": vocab,
            "ssm_cfg": ssm, "attn_layer_idx": [], "attn_cfg": {}, "rms_norm": True, "residual_in_fp32": True,
            "fused_add_norm": True, "pad_vocab_size_multiple": PAD_VOCAB, "tie_embeddings": False,
            "norm_cfg": {"norm": "QRMSNorm"}, "embedding_cfg": {"layer": embedding_layer},
            "lm_head_cfg": {"layer": lm_head_layer}}



def export_q2_files(cfg, ckpt, windows: torch.Tensor, tmp, emit, progress) -> None:
    """Calibrate every block of the Mamba-2 `ckpt` and write the checkpoint into the new directory `tmp`.
    cfg: runner.export.ExportConfig."""
    dims, depth = ckpt.dims, ckpt.dims.n_layer - 1
    bank = WeightBank(ckpt)
    result = calibrate_key(bank, windows, cfg.calib, depth,
                           ckpt.prefix_hashes(depth), cfg.cache_dir, "quamba2", progress=progress)
    emit(f"calibration: {result.info['source']} ({cfg.calib.num_samples} samples x {cfg.calib.seqlen} tokens, "
         f"layers 0..{depth}, {result.info['seconds']} s)")
    embed = lambda ids: bank.embed(ids, True, torch.float16, "exact", "fp16")  # noqa: E731  (the calibration model's)
    lm_scale = None
    if cfg.quantize_lm_head:
        with progress.stage("observing lm_head's input", -(-windows.shape[0] // cfg.calib.batch_size), "batches"):
            lm_scale = q2_lm_head_scale(dims, bank.raw, embed, windows, [s.reorder for s in result.scales],
                                        cfg.calib.batch_size, Q2_CALIBRATION_RECIPE, step=progress.advance)
    blocks = []
    with progress.stage("quantizing the weights", dims.n_layer, "layers"):
        for i, s in enumerate(result.scales):
            blocks.append(q2_state_dict(i, q2_params(bank.raw(i), s, dims), s, s.ssm_state_scale))
            bank.release(i)
            progress.advance()
    vocab = dims.vocab_size
    rows = vocab + (PAD_VOCAB - vocab % PAD_VOCAB) % PAD_VOCAB
    mode = get_mode("q2-w8a8")
    table = bank.embed(torch.arange(vocab)[None], True, torch.float16, mode.prep, mode.weights)[0].to(torch.float16)
    table = pad_rows(table, rows)
    if cfg.quantize_embedding:  # W8O16Embedding.from_fp16 (qEmbedding.py:81-91)
        codes, scales = quantize_rows_signed_max_fp16(table)
        embedding = {"backbone.embedding.weight": codes, "backbone.embedding.scales": scales}
    else:
        embedding = {"backbone.embedding.weight": table}
    lm_head = pad_rows(build_head(mode, bank).weight.to(torch.float16), rows)  # the mode's own fp16 head
    if cfg.quantize_lm_head:  # W8A8B16O16Linear.from_fp16 (qLinearLayer.py:771-785)
        lm_head = quantize_weight_fp16(lm_head)
    config = q2_config(dims, vocab, "W8O16Embedding" if cfg.quantize_embedding else "Embedding",
                       "W8A8B16O16Linear" if cfg.quantize_lm_head else "Linear")
    write_quamba2(tmp, config, blocks, embedding=embedding, lm_head=lm_head,
                  lm_head_input_scale=lm_scale, d_model=dims.d_model)
