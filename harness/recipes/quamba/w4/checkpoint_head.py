"""The W4 embedding and lm_head of Quamba2's W4A8 / W4A16 checkpoints (Mamba-1: recipes.quamba.w4.checkpoint_mamba1, Mamba-2:
recipes.quamba.w4.checkpoint_mamba2): what ``quantize_fp16_model`` writes with ``--quantize_embedding --quantize_lm_head``
(eval.sh:24-41 passes both for every W4 recipe), checked key by key and read as the kernels compute them.

enyac-group/Quamba c474646:

* ``embedding_cfg.layer`` ``W4O16Embedding`` (modelutils_mamba.py:589-590, 619-620; quamba/qEmbedding.py:8-51):
  ``weight`` int32 [vocab, d_model / 8], ``scales`` fp16 [vocab] (:18-23). ``from_fp16`` (:26-47): per row
  s = max(row) / 8, code = clamp(round(e / s + 8), 0, 15), each run of eight codes interleaved [0 2 4 6 1 3 5 7]
  and packed, interleaved value i of a run in bits 4i..4i+3 of its int32 (:39-43). The lookup
  (csrc/embedding/quant_embedding_kernel.cuh:139-206) takes nibbles (0, 4), (1, 5), then of ``q >> 8`` (2, 6),
  (3, 7) as fp16 ``code - 8`` (exact) and multiplies by the fp16 scale in fp16: the run back in its original
  order, each value f16(s * (code - 8)) (one rounding: the product is exact in fp32). The kernel runs 32 values
  at a time (:193), so d_model must be a multiple of 32.
* ``lm_head_cfg.layer`` per recipe (modelutils_mamba.py:647-657): W4A16 ``W4A16B16O16Linear`` (qLinearLayer.py:
  13-107; norm_f stays the fp16 RMSNorm, quamba_mixer_seq.py:334-338 builds it from ``norm_cfg.norm``); W4A8
  ``W4A8B16O16Linear`` (qLinearLayer.py:139-248) with norm_f a ``QRMSNorm`` at ``lm_head:input``, which is also
  the head's ``input_scale`` (modelutils_mamba.py:655-657: the Python float and the fp32 tensor of one value). The
  out-features (the padded vocab) are padded to 256 (W4A16, qLinearLayer.py:24-26) or 64 (W4A8, :150-152);
  W4A8's ``s_channel`` has no output scale divided in (marlin_utils.py:254-256, ``out_scales`` None). Marlin's
  group packing needs d_model a multiple of 128 above 128 (a smaller in_features is packed per channel,
  qLinearLayer.py:46, 177).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ....checkpoints.loading import ModelDirError
from ..checkpoint import F, check_spec
from .checkpoint_blocks import marlin_spec, w4_kind_ok, w4_describe_kind
from ..checkpoint_checks import layer_kind, check_values
from ....kernels.marlin import unpack_marlin, unpack_marlin_qqq

__all__ = ["W4_HEADS", "w4_head_kinds", "w4_top_spec", "check_w4_top", "w4_embedding_rows", "W4HeadMixin"]

W4_HEADS = {"W4A16": "W4A16B16O16Linear", "W4A8": "W4A8B16O16Linear"}  # modelutils_mamba.py:650-657
W4_EMBEDDING = "W4O16Embedding"
_INTERLEAVE = (0, 2, 4, 6, 1, 3, 5, 7)  # qEmbedding.py:33
_ROWS = 4096  # rows unpacked at a time (int64 temporaries)


def w4_head_kinds(path: Path | None, cfg: dict, recipe: str, refuse) -> dict:
    """The embedding and lm_head classes of a W4 checkpoint of `recipe` ("W4A8" or "W4A16"): fp16 or
    W4O16Embedding, Linear or the recipe's W4 head; else ``refuse(path, what)`` (the caller's ModelDirError)."""
    kinds = {"embedding": layer_kind(path, cfg, "layer", "embedding_cfg", "Embedding"),  # quamba_mixer_seq.py:290
             "lm_head": layer_kind(path, cfg, "layer", "lm_head_cfg", "Linear")}  # quamba_mixer_seq.py:412
    if kinds["embedding"] not in ("Embedding", W4_EMBEDDING):
        raise refuse(path, f"embedding_cfg.layer {kinds['embedding']!r} with {recipe} "
                           f"(valid: Embedding, {W4_EMBEDDING})")
    if kinds["lm_head"] not in ("Linear", W4_HEADS[recipe]):
        raise refuse(path, f"lm_head_cfg.layer {kinds['lm_head']!r} with {recipe} (valid: Linear, {W4_HEADS[recipe]})")
    return kinds


def w4_top_spec(d_model: int, vocab: int, kinds: dict, recipe: str) -> dict:
    """key -> kind of the embedding, norm_f and lm_head entries (module docstring)."""
    if kinds["embedding"] == W4_EMBEDDING:  # qEmbedding.py:18-23
        spec = {"backbone.embedding.weight": (torch.int32, (vocab, d_model // 8)),
                "backbone.embedding.scales": (torch.float16, (vocab,))}
    else:
        spec = {"backbone.embedding.weight": (torch.float16, (vocab, d_model))}
    spec["backbone.norm_f.weight"] = (torch.float16, (d_model,))
    if kinds["lm_head"] == "Linear":
        spec["lm_head.weight"] = (torch.float16, (vocab, d_model))
        return spec
    if recipe == "W4A8":  # QRMSNorm.store_hook: a Python float (qNorm.py:38-39)
        spec["backbone.norm_f.output_scale"] = F
    spec.update(marlin_spec("", "lm_head", d_model, vocab, recipe == "W4A8"))
    return spec


def check_w4_top(path: Path, f: Path, sd: dict, dims, kinds: dict, recipe: str, context: str) -> None:
    """Every embedding, norm_f and lm_head key by dtype, shape and value, else ModelDirError naming it."""
    d = dims.d_model
    if kinds["embedding"] == W4_EMBEDDING and d % 32:
        raise ModelDirError(f"{path}: a {W4_EMBEDDING} needs d_model a multiple of 32 (the lookup kernel reads 32 "
                            f"values at a time, quant_embedding_kernel.cuh:193), got {d}; supported: {context}")
    if kinds["lm_head"] != "Linear" and (d % 128 or d <= 128):
        raise ModelDirError(f"{path}: a {kinds['lm_head']} lm_head needs d_model a multiple of 128 above 128 (Marlin "
                            f"packs 128 or fewer in-features per channel, qLinearLayer.py:46, 177), got {d}; "
                            f"supported: {context}")
    spec = w4_top_spec(d, dims.vocab_size, kinds, recipe)
    check_spec(f, sd, spec, context, w4_kind_ok, w4_describe_kind)
    check_values(f, sd, spec)  # scales > 0 (input_scale, output_scale), float tensors finite
    if kinds["lm_head"] == "Linear":
        return
    groups = "lm_head.s_group" if recipe == "W4A8" else "lm_head.scale"
    scales = [groups, "lm_head.s_channel"] if recipe == "W4A8" else [groups]
    for key in scales:  # a zero head row has channel scale 0 and group scales 0 (marlin_utils.py:184-192, 252)
        bad = ~(torch.isfinite(sd[key]) & (sd[key] >= 0))
        if bool(bad.any()):
            raise ModelDirError(f"{f}: {key!r} holds {int(bad.sum())} scales that are negative, NaN or infinite; "
                                f"a Marlin weight scale must be a finite number >= 0")
    if recipe == "W4A8":
        a, b = float(sd["backbone.norm_f.output_scale"]), float(sd["lm_head.input_scale"])
        if a != b:
            raise ModelDirError(f"{f}: 'backbone.norm_f.output_scale' = {a} and 'lm_head.input_scale' = {b} must be "
                                f"equal (quantize_fp16_model stores lm_head:input in both, "
                                f"modelutils_mamba.py:655-657)")


def w4_embedding_rows(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """W4O16Embedding's ``weight`` [vocab, d / 8] int32 and ``scales`` [vocab] fp16 -> the (vocab, d) fp16 rows
    the lookup kernel returns, f16(s * (code - 8)) (module docstring)."""
    vocab, words_per_row = packed.shape
    out = torch.empty(vocab, words_per_row * 8, dtype=torch.float16)
    for r in range(0, vocab, _ROWS):
        words = packed[r:r + _ROWS].to(torch.int64) & 0xFFFFFFFF
        codes = torch.empty(words.shape[0], words_per_row, 8, dtype=torch.int64)
        for nibble, original in enumerate(_INTERLEAVE):  # nibble i holds the run's value interleave[i]
            codes[:, :, original] = (words >> (4 * nibble)) & 0xF
        values = codes.reshape(words.shape[0], -1).to(torch.float32) - 8.0  # exact
        out[r:r + _ROWS] = (values * scales[r:r + _ROWS].to(torch.float32)[:, None]).to(torch.float16)
    return out


class W4HeadMixin:
    """embedding() and lm_head() of a W4 checkpoint (kinds, recipe, dims, _get, _scalar of QuambaCheckpoint): a
    W4O16Embedding's rows and a W4 lm_head's unpacked Marlin weight; the fp16 ones as Quamba1's."""

    def embedding(self) -> torch.Tensor:
        if self.kinds["embedding"] != W4_EMBEDDING:
            return super().embedding()
        if self._embedding is None:
            self._embedding = w4_embedding_rows(self._get("backbone.embedding.weight"),
                                                self._get("backbone.embedding.scales"))
        return self._embedding

    def lm_head(self):
        """(weight, input scale, None): the fp16 head as Quamba1's; W4A16B16O16Linear's Int4Weight [vocab, d_model]
        with None (its input is norm_f's fp16 output); W4A8B16O16Linear's Int4Weight with channel scales and
        norm_f's output scale (QRMSNorm, qNorm.py:38-39; = lm_head.input_scale, checked at open)."""
        if self.kinds["lm_head"] == "Linear":
            return super().lm_head()
        vocab = self.dims.vocab_size
        if self.recipe == "W4A8":
            w = unpack_marlin_qqq(self._get("lm_head.weight"), self._get("lm_head.s_group"),
                                  self._get("lm_head.s_channel"), vocab)
            return w, self._scalar("backbone.norm_f.output_scale"), None
        return unpack_marlin(self._get("lm_head.weight"), self._get("lm_head.scale"), vocab), None, None

