"""Weights of one block as a recipe needs them: folded and rotated, rounded to fp32/fp16, or int8.

Offline transforms (notes §2.1): fold the block's RMSNorm weight into in_proj's
columns (W_in[:, j] *= w_norm[j]) and rotate the residual stream with Had_D (see
ops.hadamard): a residual vector x becomes Had_D x, so in_proj becomes W_in Had_D^T
(each row transformed), out_proj becomes Had_D W_out Had_E^T (the online Hadamard of
the SSM output supplies Had_E), and the embedding rows become Had_D e.

Two preparations (knob ``prep``):

* ``exact``: from the checkpoint's own precision, fold and rotation in float64,
  rounded once to the weight dtype (``float_layer``);
* ``quamba``: as Quamba computes them (``quamba_fp16_layer``, notes §2.1a): the
  checkpoint is first brought to fp16 (``build_mamba_and_tokenizer`` loads it with
  dtype=torch.float16, utils.py:21, 30); ``fuse_ln_linear`` multiplies the fp16
  in_proj by the fp16 norm weight in float64 and stores fp16 (modelutils_mamba.py:40-55,
  called at :76); ``fuse_hadamard`` (qLinearLayer.py:860-868) rotates in_proj's rows,
  and out_proj over its input dim then over its output dim, each with the
  fast_hadamard_transform kernel (fp32 butterflies over fp16 inputs,
  ops.hadamard.hadamard_transform_fht), storing fp16 after each transform; the
  embedding is rotated the same way (configure_model, modelutils_mamba.py:66).

For int8 the fp16 result is quantized per tensor (ops.quant.quantize_weight_fp16),
and A_log, D and dt_bias (fp32, dt_bias holding its fp16 value) with
quantize_param_fp32, as Quamba does after loading its fp16 model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .loading import Checkpoint
from .memory import release_freed
from .ops.hadamard import hadamard_transform, hadamard_transform_fht
from .ops.quant import quantize_param_fp32, quantize_weight_fp16, round_to_dtype
from .spec import FLOAT_DTYPES, QTensor

__all__ = ["LayerParams", "PREPS", "float_layer", "quamba_fp16_layer", "quamba_int8_layer", "int8_layer", "fht_fp16",
           "WeightBank", "FloatModelRequired", "lm_head_weight"]

PREPS: tuple[str, ...] = ("quamba", "exact")  # the values of the `prep` knob


@dataclass
class LayerParams:
    """Prepared parameters of one block; float tensors are fp32 holding values of their dtype.

    in_proj: (2 * d_inner, d_model); conv_weight: (d_inner, d_conv); conv_bias: (d_inner,);
    x_proj: (dt_rank + 2 * d_state, d_inner); dt_proj: (d_inner, dt_rank); dt_bias, D: (d_inner,);
    A_log: (d_inner, d_state); out_proj: (d_model, d_inner); norm_weight: (d_model,) or None (folded).
    """

    norm_weight: torch.Tensor | None
    in_proj: torch.Tensor | QTensor
    conv_weight: torch.Tensor | QTensor
    conv_bias: torch.Tensor | QTensor | None
    x_proj: torch.Tensor | QTensor
    dt_proj: torch.Tensor | QTensor
    dt_bias: torch.Tensor | QTensor
    A_log: torch.Tensor | QTensor
    D: torch.Tensor | QTensor
    out_proj: torch.Tensor | QTensor


def float_layer(raw: dict[str, torch.Tensor | None], rotate: bool, dtype: torch.dtype) -> LayerParams:
    """raw: fp32 tensors of the checkpoint (loading.Checkpoint.raw_layer)."""
    def rnd(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else round_to_dtype(t, dtype)

    in_proj, out_proj, norm_weight = rnd(raw["in_proj"]), rnd(raw["out_proj"]), rnd(raw["norm_weight"])
    if rotate:
        folded = rnd(raw["in_proj"].to(torch.float64) * raw["norm_weight"].to(torch.float64))
        in_proj = rnd(hadamard_transform(folded))                                  # W Had_D^T
        right = hadamard_transform(out_proj)                                      # W Had_E^T
        out_proj = rnd(hadamard_transform(right.t()).t())                         # Had_D (W Had_E^T)
        norm_weight = None
    return LayerParams(
        norm_weight=norm_weight, in_proj=in_proj, conv_weight=rnd(raw["conv_weight"]), conv_bias=rnd(raw["conv_bias"]),
        x_proj=rnd(raw["x_proj"]), dt_proj=rnd(raw["dt_proj"]), dt_bias=rnd(raw["dt_bias"]),
        A_log=raw["A_log"].to(torch.float32), D=raw["D"].to(torch.float32),  # mamba keeps A_log and D in fp32
        out_proj=out_proj)


def fht_fp16(w: torch.Tensor) -> torch.Tensor:
    """One fast_hadamard_transform call on an fp16 tensor, rows along the last dim: fp16 out (held in fp32)."""
    return round_to_dtype(hadamard_transform_fht(round_to_dtype(w, torch.float16)), torch.float16)


def quamba_fp16_layer(raw: dict[str, torch.Tensor | None], rotate: bool = True) -> LayerParams:
    """The fp16 weights of one block exactly as Quamba prepares them (prep=quamba; module docstring).

    raw: fp32 tensors of the checkpoint (loading.Checkpoint.raw_layer). Returns fp16 values held
    in fp32 (A_log and D stay fp32: mamba_ssm creates them as fp32 parameters, notes §1.3). With
    rotate=False nothing is folded or rotated: the checkpoint rounded to fp16, the same as prep=exact.
    """
    if not rotate:
        return float_layer(raw, False, torch.float16)
    f16 = lambda t: round_to_dtype(t, torch.float16)  # noqa: E731
    in16, norm16 = f16(raw["in_proj"]), f16(raw["norm_weight"])
    folded = f16(in16.to(torch.float64) * norm16.to(torch.float64))      # fuse_ln_linear: fp64 product, fp16 store
    in_proj = fht_fp16(folded)                                             # W Had_D^T, fp16 store
    right = fht_fp16(f16(raw["out_proj"]))                                 # input transform: W Had_E^T, fp16 store
    out_proj = fht_fp16(right.t()).t()                                     # output transform on W.t(), fp16 store
    return LayerParams(
        norm_weight=None, in_proj=in_proj, conv_weight=f16(raw["conv_weight"]),
        conv_bias=None if raw["conv_bias"] is None else f16(raw["conv_bias"]),
        x_proj=f16(raw["x_proj"]), dt_proj=f16(raw["dt_proj"]), dt_bias=f16(raw["dt_bias"]),
        A_log=raw["A_log"].to(torch.float32), D=raw["D"].to(torch.float32), out_proj=out_proj)


def quamba_int8_layer(raw: dict[str, torch.Tensor | None], rotate: bool = True) -> LayerParams:
    """Quamba's W8A8 weights of one block: int8_layer(quamba_fp16_layer(raw, rotate))."""
    return int8_layer(quamba_fp16_layer(raw, rotate))


def int8_layer(fp16: LayerParams) -> LayerParams:
    """Per-tensor int8 of an fp16 layer; the norm weight (unrotated models) stays fp16."""
    return LayerParams(
        norm_weight=fp16.norm_weight, in_proj=quantize_weight_fp16(fp16.in_proj),
        conv_weight=quantize_weight_fp16(fp16.conv_weight),
        conv_bias=None if fp16.conv_bias is None else quantize_weight_fp16(fp16.conv_bias),
        x_proj=quantize_weight_fp16(fp16.x_proj), dt_proj=quantize_weight_fp16(fp16.dt_proj),
        dt_bias=quantize_param_fp32(fp16.dt_bias), A_log=quantize_param_fp32(fp16.A_log),
        D=quantize_param_fp32(fp16.D), out_proj=quantize_weight_fp16(fp16.out_proj))


class FloatModelRequired(ValueError):
    """A recipe needs float weights, but only a quantized checkpoint was given."""


class WeightBank:
    """Prepares each (layer, weights, rotate, prep) variant once and shares it between modes.

    ckpt: the float checkpoint (None when only a quantized checkpoint is at hand).
    given: a quantized checkpoint (quamba_ckpt.QuambaCheckpoint) whose int8 codes and scales are
    used bit for bit as the rotated int8 prep=quamba layers and whose rotated fp16 embedding rows feed
    those recipes:
    it provides ``dims``, ``int8_layer(i)`` and ``embedding()``.
    """

    def __init__(self, ckpt: Checkpoint | None, given=None) -> None:
        assert ckpt is not None or given is not None, "a weight bank needs a checkpoint"
        self.ckpt, self.given = ckpt, given
        self._raw: dict[int, dict] = {}
        self._layers: dict[tuple[int, str, bool, str], LayerParams] = {}
        self._wanted: set[tuple[str, bool, str]] | None = None  # the variants to keep (None: every one)
        self._embedded: dict[tuple[bool, torch.dtype, str, bool], tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def dims(self):
        return (self.given or self.ckpt).dims

    def _uses_given(self, weights: str, rotate: bool, prep: str) -> bool:
        """A given Quamba checkpoint holds exactly the int8 weights of prep=quamba, rotated."""
        return self.given is not None and weights == "int8" and rotate and prep == "quamba"

    def _float(self, what: str) -> Checkpoint:
        if self.ckpt is None:
            raise FloatModelRequired(f"{what} needs the float model; pass --mamba_model_path DIR "
                                     f"(the quantized checkpoint only holds rotated int8 weights)")
        return self.ckpt

    def raw(self, layer: int) -> dict[str, torch.Tensor | None]:
        if layer not in self._raw:
            self._raw[layer] = self._float("float weights").raw_layer(layer)
        return self._raw[layer]

    def layer(self, layer: int, weights: str, rotate: bool, prep: str = "exact") -> LayerParams:
        """weights: "fp32", "fp16" or "int8" (int8 is quantized from the fp16 variant, or given); prep: see PREPS."""
        if prep not in PREPS:
            raise ValueError(f"unknown prep {prep!r}; valid: {', '.join(PREPS)}")
        key = (layer, weights, rotate, prep)
        if key in self._layers:
            return self._layers[key]
        if self._uses_given(weights, rotate, prep):
            params = self.given.int8_layer(layer)
        elif weights == "int8":
            params = int8_layer(self.layer(layer, "fp16", rotate, prep))
        elif prep == "quamba":
            if weights != "fp16":
                raise ValueError("prep=quamba prepares fp16 weights (Quamba's model is fp16); "
                                 f"weights={weights} needs prep=exact")
            params = quamba_fp16_layer(self.raw(layer), rotate)
        else:
            params = float_layer(self.raw(layer), rotate, FLOAT_DTYPES[weights])
        if self._wanted is None or key[1:] in self._wanted:
            self._layers[key] = params
        if self._wanted is not None and layer in self._raw:  # a caller that said what it needs: no raw kept
            del self._raw[layer]
            self._float("float weights").drop_pages()
        release_freed()  # the float64 folding and rotation buffers, freed, leave the process too
        return params

    def keep_only(self, variants: set[tuple[str, bool, str]]) -> None:
        """Forget every prepared (weights, rotate, prep) variant not in `variants`, and the raw float
        tensors (read again on demand): a caller running modes one after the other calls it after each
        with what the modes still to come need, so memory holds those variants, not every one seen."""
        self._raw.clear()
        self._wanted = set(variants)  # from now on a variant outside them (int8's fp16 source) is not kept
        for key in [k for k in self._layers if k[1:] not in variants]:
            del self._layers[key]
        for ckpt in (self.ckpt, self.given):
            if hasattr(ckpt, "drop_pages"):
                ckpt.drop_pages()
        release_freed()

    def release(self, layer: int) -> None:
        """Forget the raw and prepared tensors of one block (a caller walking every layer keeps memory flat)."""
        self._raw.pop(layer, None)
        for key in [k for k in self._layers if k[0] == layer]:
            del self._layers[key]

    def embed(self, ids: torch.Tensor, rotate: bool, dtype: torch.dtype, prep: str = "exact",
              weights: str = "fp32") -> torch.Tensor:
        """ids: (batch, seqlen) int64 -> (batch, seqlen, d_model) fp32 holding `dtype` values.

        prep=quamba rotates the fp16 rows with the kernel's arithmetic (fp16 store), as
        configure_model rotates the fp16 embedding table (rows are independent); int8 prep=quamba
        recipes read a given checkpoint's (already rotated) rows when there is one.
        The last result per (rotate, dtype, prep, source) is kept, so modes sharing an embedding compute it once.
        """
        given = self._uses_given(weights, rotate, prep)
        last = self._embedded.get((rotate, dtype, prep, given))
        if last is not None and torch.equal(last[0], ids):
            return last[1]
        if given:
            out = round_to_dtype(self.given.embedding()[ids].to(torch.float32), dtype)
        else:
            raw_rows = self._float("the float embedding").embedding()[ids].to(torch.float32)
            if rotate and prep == "quamba":
                out = round_to_dtype(fht_fp16(raw_rows), dtype)
            else:
                rows = round_to_dtype(raw_rows, dtype)
                out = round_to_dtype(hadamard_transform(rows), dtype) if rotate else rows
        self._embedded[(rotate, dtype, prep, given)] = (ids.clone(), out)
        return out


def lm_head_weight(ckpt: Checkpoint) -> torch.Tensor:
    """(vocab, d_model) fp16 lm_head as Quamba prepares it (modelutils_mamba.py:64-70): the fp16 model's
    lm_head (the embedding when tied) times the fp16 final-norm weight, rounded to fp16, then rotated
    with the fast_hadamard_transform kernel's arithmetic (fp16 store), like the embedding."""
    w = ckpt.tensor("lm_head.weight") if ckpt.has("lm_head.weight") else ckpt.embedding()
    w16 = round_to_dtype(w.to(torch.float32), torch.float16)
    norm = round_to_dtype(ckpt.tensor("backbone.norm_f.weight").to(torch.float32), torch.float16)
    folded = round_to_dtype(w16.to(torch.float64) * norm.to(torch.float64), torch.float16)
    return fht_fp16(folded)
