"""``python -m harness export --recipe w4a8|w4a16`` of a Mamba-2 model: a ``W4A8QMamba2`` / ``W4A16QMamba2`` checkpoint.

The int4 weights are the q2-w4a8 / q2-w4a16 mode's GPTQ (recipes.quamba.w4.calibrate_mamba2, its cache shared with capture), packed
as Marlin-QQQ / Marlin (kernels.marlin; in_proj's channel scales carry the splits' output scales, as
``w4a8_quantize(out_scales=)`` fuses them, enyac-group/Quamba c474646 quamba/marlin_utils.py:254-256). W4A8's
activation path is q2-w8a8's (recipes.quamba.q2.checkpoint.q2_state_dict without its int8 linears; ``W4A8QMamba2``
builds W8A8's conv1d, qchunk_scan, norm and had, qMamba2.py:800-824), with ``input_scale`` s_in and s_H on the
linears (qLinearLayer.py:139-215, 420-505). W4A16 keeps the rotated fp16 model's conv1d, dt_bias, A_log, D and
gated-norm weight (qMamba2.py:447-485: A_log fp16 as the fp16 model holds it, D fp32). The embedding and lm_head
are the mode's own fp16 ones (``Embedding``, ``Linear``): W4 embeddings and heads are not written. Reading
the export back (recipes.quamba.w4.checkpoint_mamba2) gives the mode's arrays bit for bit.
"""
from __future__ import annotations

import torch

from ..families import calibrate_key
from ..checkpoint import PAD_VOCAB, pad_rows
from ..q2.export import q2_config
from ....runner.forwards import build_head
from ....runner.weightbank import WeightBank
from ..q2.checkpoint import q2_state_dict, write_quamba2
from .block_mamba2 import Q2W4Layer
from ....kernels.marlin import pack_marlin, pack_marlin_qqq
from ..q2.params import q2_params
from ....architectures.mamba2.weights import float_layer_mamba2
from ...registry import get_mode
from ....spec import Mamba2Dims

__all__ = ["check_q2w4_export", "export_q2w4_files", "w4_block_state_dict", "marlin_entries"]


def check_q2w4_export(dims: Mamba2Dims, quantize_embedding: bool, quantize_lm_head: bool) -> str | None:
    """Why this model cannot be exported as a W4 checkpoint, or None."""
    for name, k in (("d_model (in_proj's in-features)", dims.d_model), ("d_inner (out_proj's)", dims.d_inner)):
        if k % 128 or k <= 128:
            return (f"Marlin's per-group int4 packing needs {name} a multiple of 128 above 128 (it is {k}); "
                    f"per-channel packing is not written")
    if quantize_embedding or quantize_lm_head:
        return ("--quantize_embedding/--quantize_lm_head with a W4 recipe (W4O16Embedding, W4 lm_head) are not "
                "written; the W4 export keeps the fp16 embedding and lm_head")
    return None


def marlin_entries(prefix: str, w, input_scale: float | None) -> dict:
    out = {}
    if w.channel_scales is not None:
        weight, s_group, s_channel = pack_marlin_qqq(w)
        out.update({"input_scale": torch.tensor(input_scale, dtype=torch.float32), "s_channel": s_channel,
                    "s_group": s_group})
    else:
        weight, scale = pack_marlin(w)
        out["scale"] = scale
    n = weight.shape[1] // 2
    return {f"{prefix}.workspace": torch.zeros((n // 64) * 16, dtype=torch.int32), f"{prefix}.weight": weight,
            **{f"{prefix}.{k}": v for k, v in out.items()}}


def w4_block_state_dict(i: int, raw: dict, w4: Q2W4Layer, dims: Mamba2Dims) -> dict:
    """Block i's entries of a W4A8QMamba2 (w4.scales given) or W4A16QMamba2 checkpoint (module docstring)."""
    p, m = f"backbone.layers.{i}.", f"backbone.layers.{i}.mixer."
    s = w4.scales
    if s is not None:
        sd = {k: v for k, v in q2_state_dict(i, q2_params(raw, s, dims), s, s.ssm_state_scale).items()
              if not k.startswith((m + "in_proj.", m + "out_proj."))}
    else:
        f = float_layer_mamba2(raw, True, torch.float16)
        h = lambda t: t.to(torch.float16).contiguous()  # noqa: E731  (fp16 values already)
        norm = torch.ones(dims.d_model) if f.norm_weight is None else f.norm_weight
        sd = {p + "norm.weight": h(norm), m + "conv1d.weight": h(f.conv_weight)[:, None].contiguous(),
              m + "dt_bias": h(f.dt_bias), m + "A_log": h(f.A_log),
              m + "D": f.D.to(torch.float32).contiguous(), m + "norm.weight": h(f.gnorm_weight)}
        if f.conv_bias is not None:
            sd[m + "conv1d.bias"] = h(f.conv_bias)
    sd.update(marlin_entries(m + "in_proj", w4.in_proj, None if s is None else s.s_in))
    sd.update(marlin_entries(m + "out_proj", w4.out_proj, None if s is None else s.s_H))
    return sd


def export_q2w4_files(cfg, ckpt, windows: torch.Tensor, tmp, emit, progress) -> None:
    """GPTQ (and for W4A8 the W8A8 calibration) of every block of the Mamba-2 `ckpt`; the checkpoint into the new
    directory `tmp`. cfg: runner.export.ExportConfig (recipe w4a8 or w4a16)."""
    dims, depth = ckpt.dims, ckpt.dims.n_layer - 1
    mode = get_mode(f"q2-{cfg.recipe}")
    bank = WeightBank(ckpt)
    result = calibrate_key(bank, windows, cfg.calib, depth,
                           ckpt.prefix_hashes(depth), cfg.cache_dir, mode.calibration_key, progress=progress)
    emit(f"calibration: {result.info['source']} ({cfg.calib.num_samples} samples x {cfg.calib.seqlen} tokens, "
         f"layers 0..{depth}, {result.info['seconds']} s)")
    blocks = []
    with progress.stage("packing the weights", dims.n_layer, "layers"):
        for i, w4 in enumerate(result.scales):
            blocks.append(w4_block_state_dict(i, bank.raw(i), w4, dims))
            bank.release(i)
            progress.advance()
    vocab = dims.vocab_size
    rows = vocab + (PAD_VOCAB - vocab % PAD_VOCAB) % PAD_VOCAB
    table = bank.embed(torch.arange(vocab)[None], True, torch.float16, mode.prep, mode.weights)[0].to(torch.float16)
    lm_head = pad_rows(build_head(mode, bank).weight.to(torch.float16), rows)  # the mode's own fp16 head
    config = q2_config(dims, vocab, "Embedding", "Linear")
    config["ssm_cfg"]["layer"] = "W4A8QMamba2" if cfg.recipe == "w4a8" else "W4A16QMamba2"
    config["norm_cfg"] = {"norm": "QRMSNorm" if cfg.recipe == "w4a8" else "RMSNorm"}  # modelutils_mamba.py:516-572
    write_quamba2(tmp, config, blocks, embedding={"backbone.embedding.weight": pad_rows(table, rows)},
                  lm_head=lm_head, d_model=dims.d_model)
