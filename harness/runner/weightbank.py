"""The run's weight bank: each (layer, weights, rotate, prep) variant of a block prepared once and
shared between the modes of a run, the embedding rows, and the lm_head weight.

The preparation itself is pure and lives in each architecture's folder (harness.architectures.*.weights); this module adds what a
run needs around it: which checkpoint to read, what to keep, and when memory goes back.
"""
from __future__ import annotations

import torch

from ..checkpoints.loading import Checkpoint
from ..architectures.mamba1.weights import LayerParams, fht_fp16
from ..architectures.registry import get_architecture
from ..kernels.hadamard import hadamard_transform
from ..kernels.quant import round_to_dtype
from ..runtime.memory import release_freed

__all__ = ["WeightBank", "FloatModelRequired", "lm_head_weight"]


class FloatModelRequired(ValueError):
    """A recipe needs float weights, but only a quantized checkpoint was given."""


class WeightBank:
    """Prepares each (layer, weights, rotate, prep) variant once and shares it between modes.

    ckpt: the float checkpoint (None when only a quantized checkpoint is at hand).
    given: a quantized checkpoint (recipes.quamba.checkpoint.QuambaCheckpoint) whose int8 codes and scales are
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
        """A given Quamba checkpoint holds exactly the int8 (Quamba2 W4: int4) weights of its prep, rotated."""
        return self.given is not None and weights == getattr(self.given, "weights", "int8") and rotate and \
            prep == getattr(self.given, "prep", "quamba")

    def q2_given(self, layer: int, key: str):
        """A given Quamba2 checkpoint's block parameters for calibration key `key` (q2-w8a8's Q2Params,
        recipes.quamba.q2.params; a W4 checkpoint's, recipes.quamba.w4.checkpoint_mamba2), else None."""
        ok = self.given is not None and getattr(self.given, "calibration_key", self.given.prep) == key
        return self.given.q2_params(layer) if ok else None

    def _float(self, what: str) -> Checkpoint:
        if self.ckpt is None:
            raise FloatModelRequired(f"{what} needs the float model; pass --mamba_model_path DIR "
                                     f"(the quantized checkpoint only holds rotated int8 weights)")
        return self.ckpt

    def raw(self, layer: int) -> dict[str, torch.Tensor | None]:
        if layer not in self._raw:
            if self._wanted is not None and self._raw:  # a caller that said what it needs (a mode's build, layer
                self._raw.clear()  # by layer): one layer's raw tensors and pages at a time, not every layer's
                self._float("float weights").drop_pages()
            self._raw[layer] = self._float("float weights").raw_layer(layer)
        return self._raw[layer]

    def layer(self, layer: int, weights: str, rotate: bool, prep: str = "exact") -> LayerParams:
        """weights: "fp32", "fp16" or "int8" (int8 is quantized from the fp16 variant, or given); prep: see PREPS."""
        key = (layer, weights, rotate, prep)
        if key in self._layers:
            return self._layers[key]
        if self._uses_given(weights, rotate, prep):
            params = self.given.int8_layer(layer)
        else:  # the architecture's own preparation (harness.architectures.*)
            params = get_architecture(self.dims.architecture).prepare_layer(
                lambda: self.raw(layer), weights, rotate, prep, lambda: self.layer(layer, "fp16", rotate, prep))
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
        self.drop_pages()
        release_freed()

    def drop_pages(self) -> None:
        """Drop the checkpoints' resident memory-mapped pages (read again from the file when touched): what a
        mode prepared is a copy, so once its blocks and head are built the pages it read need not stay."""
        for ckpt in (self.ckpt, self.given):
            if hasattr(ckpt, "drop_pages"):
                ckpt.drop_pages()

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
    norm = round_to_dtype(ckpt.tensor(ckpt.final_norm_key).to(torch.float32), torch.float16)
    folded = round_to_dtype(w16.to(torch.float64) * norm.to(torch.float64), torch.float16)
    return fht_fp16(folded)
