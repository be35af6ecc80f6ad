"""A Quamba2 W4A8 or W4A16 checkpoint as what the q2-w4a8 / q2-w4a16 modes run on, with no calibration and no GPTQ.

enyac-group/Quamba c474646. A non-hybrid ``W4A8QMamba2`` / ``W4A16QMamba2`` directory (recipes.quamba.w4.checkpoint_blocks
checks and unpacks its blocks) becomes, per layer, the ``Q2W4Layer`` the GPTQ calibration hands to the build
(recipes.quamba.w4.calibrate_mamba2): the Marlin-unpacked ``Int4Weight`` of in_proj (its channel scales with each split's output
scale divided in, marlin_utils.py:254-256, as q2_gptq.q2w4_layers divides them) and out_proj, and for W4A8 the
W8A8 scales, read as from a W8A8 checkpoint (recipes.quamba.q2.checkpoint: the W4A8 mixer's conv1d, qchunk_scan, norm and
had are W8A8QMamba2's, qMamba2.py:800-824, under the same keys). The block's other tensors (``q2_params``): W4A8
the stored int8 conv, A_log, D and fp16 dt_bias, gated-norm weight (in_proj and out_proj placeholders, the block
runs the Marlin linears); W4A16 the fp16 model's conv1d, dt_bias, A_log, D and gated-norm weight as stored
(qMamba2.py:447-485).

Channel order: W4A16 is not reordered (modelutils_mamba.py:820-825), its order is the float model's. W4A8 is
stored reordered like W8A8; with the float model the order is recovered (recipes.quamba.q2.order.recover_order_w4),
without it the taps come in the checkpoint's order.

The embedding and lm_head: fp16, or what --quantize_embedding / --quantize_lm_head write (W4O16Embedding, the
recipe's W4A16B16O16Linear or W4A8B16O16Linear head), checked and read by recipes.quamba.w4.checkpoint_head.

Refused by name: hybrid W4AX checkpoints (which mixer of a layer runs is chosen at run time, qBlock.py:60-77,
quamba_mixer_seq.py:162-173, not stored).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ....checkpoints.loading import ModelDirError
from ..checkpoint import read_config, parse_config
from ..q2.checkpoint import Quamba2Checkpoint
from .checkpoint_blocks import W4_MIXERS, W4Block, check_w4_blocks, load_w4, w4_plan
from ..checkpoint_checks import layer_kind
from .checkpoint_head import W4HeadMixin, check_w4_top, w4_head_kinds
from .block_mamba2 import Q2W4Layer
from ....architectures.mamba2.weights import Mamba2Params

__all__ = ["Quamba2W4Checkpoint", "open_quamba2_w4", "is_w4_config", "SUPPORTED_W4"]

SUPPORTED_W4 = ("Quamba2 W4 checkpoints: ssm_cfg.layer W4A8QMamba2 (norm_cfg.norm QRMSNorm) or W4A16QMamba2 "
                "(RMSNorm), embedding_cfg.layer Embedding or W4O16Embedding, lm_head_cfg.layer Linear or the "
                "recipe's W4A8B16O16Linear / W4A16B16O16Linear, not hybrid")
_NORM = {"W4A8": "QRMSNorm", "W4A16": "RMSNorm"}  # modelutils_mamba.py:516-572


def is_w4_config(cfg: dict) -> bool:
    ssm = cfg.get("ssm_cfg") if isinstance(cfg.get("ssm_cfg"), dict) else {}
    layer = ssm.get("layer")
    return bool(cfg.get("is_hybrid")) or isinstance(layer, list) or layer in W4_MIXERS


class Quamba2W4Checkpoint(W4HeadMixin, Quamba2Checkpoint):
    """A validated W4A8 or W4A16 directory (module docstring); ``prep`` is the recipe prep whose blocks it
    holds, ``weights`` "int4", ``calibration_key`` the calibration it replaces."""

    weights = "int4"

    def __init__(self, path: Path, cfg: dict, sd: dict, dims, kinds: dict, blocks: list[W4Block]) -> None:
        super().__init__(path, cfg, sd, dims, kinds)
        self.blocks, self.recipe = blocks, blocks[0].recipe
        self.format = f"quamba2-{self.recipe.lower()}"
        self.calibration_key = self.format

    def attach_float(self, float_ckpt) -> None:
        from ..q2.order import recover_order_w4

        def source(i: int) -> tuple[torch.Tensor, torch.Tensor]:
            b = self.blocks[i]
            raw = float_ckpt.raw_layer(i)
            channels, heads, summary = recover_order_w4(b.in_proj, b.recipe, b.tensors, raw, self.dims)
            self.order_summary[i] = summary
            return channels, heads

        self.order_source, self.order_summary = source, {}

    def reorder(self, i: int):
        if self.recipe == "W4A8":
            return super().reorder(i)
        if self.order_source is not None and i not in self.order_summary:  # W4A16: the identity, checked
            self.order_source(i)
        return None

    def layer_scales(self, i: int) -> Q2W4Layer:
        b = self.blocks[i]
        w8a8 = Quamba2Checkpoint.layer_scales(self, i) if self.recipe == "W4A8" else None
        return Q2W4Layer(b.in_proj, b.out_proj, w8a8)

    def q2_params(self, i: int):
        """W4A8: Q2Params of the stored activation path (the linears are placeholders, the block runs the Marlin
        ones); W4A16: the fp16 block's Mamba2Params as stored (in_proj and out_proj placeholders likewise)."""
        d, t = self.dims, self.blocks[i].tensors
        if self.recipe == "W4A16":
            f32 = lambda k: t[k].to(torch.float32).clone()  # noqa: E731
            norm = t["norm:weight"].to(torch.float32)
            return Mamba2Params(
                norm_weight=None if bool((norm == 1).all()) else norm.clone(),  # folded (modelutils_mamba.py:55)
                in_proj=torch.zeros(0, d.d_model), conv_weight=f32("conv1d.weight")[:, 0],
                conv_bias=f32("conv1d.bias") if "conv1d.bias" in t else None, dt_bias=f32("dt_bias"),
                A_log=f32("A_log"), D=f32("D"), gnorm_weight=f32("norm.weight"), out_proj=torch.zeros(d.d_model, 0))
        return super().q2_params(i)

    def in_proj_codes(self, i: int) -> torch.Tensor:
        """A placeholder: the W4A8 block's in_proj is the Marlin-QQQ one (EmuQ2W4A8Block._in_proj)."""
        d = self.dims
        return torch.zeros(2 * d.d_inner + 2 * d.ngroups * d.d_state + d.nheads, d.d_model, dtype=torch.int8)

    def _m(self, i: int, key: str):
        if key == "in_proj.b":
            return torch.zeros(1, self.in_proj_codes(i).shape[0])
        if key == "out_proj.weight":  # placeholder codes, stored as the transposed view
            return torch.zeros(self.dims.d_inner, self.dims.d_model, dtype=torch.int8)
        return super()._m(i, key)

    def _scalar(self, key: str) -> float:
        return 1.0 if key.endswith("mixer.out_proj.b") else super()._scalar(key)

    def info(self) -> dict:
        return {"ssm_layer": f"{self.recipe}QMamba2", **self.kinds,
                "channel_order": "the float model's (not reordered)" if self.recipe == "W4A16" else
                "recovered from the float model" if self.order_source else "the checkpoint's own",
                "int4": "Marlin" + ("-QQQ" if self.recipe == "W4A8" else "") + " unpacked (kernels.marlin)"}


def _refuse(path: Path, what: str) -> ModelDirError:
    return ModelDirError(f"{path}: {what} is not supported; supported: {SUPPORTED_W4}")


def _refuse_hybrid(path: Path, table) -> None:
    """table: ssm_cfg.layer (a list of {recipe: class} per layer, or whatever the config holds)."""
    layers = "; ".join(f"layer {i}: {'+'.join(m) if isinstance(m, dict) else repr(m)}" for i, m in enumerate(table)) \
        if isinstance(table, list) else f"ssm_cfg.layer {table!r}"
    raise ModelDirError(
        f"{path}: a hybrid W4AX checkpoint ({layers}) is not supported: Quamba's hybrid model (a W4O16Embedding, a "
        f"QRMSNorm norm_f and a W4A8B16O16Linear lm_head, quamba_mixer_seq.py:201, 239, 408-409) chooses which mixer "
        f"each layer runs at run time (qBlock.py:60-77); that choice is not stored; supported: {SUPPORTED_W4}")


def open_quamba2_w4(path: Path | str) -> Quamba2W4Checkpoint:
    """Validate config, every block key (recipes.quamba.w4.checkpoint_blocks) and the embedding, norm_f and lm_head keys, or
    raise ModelDirError naming what is wrong and what is valid."""
    path = Path(path)
    cfg = read_config(path)
    ssm = cfg.get("ssm_cfg") if cfg is not None and isinstance(cfg.get("ssm_cfg"), dict) else {}
    if cfg is not None and (cfg.get("is_hybrid") or isinstance(ssm.get("layer"), list)):
        _refuse_hybrid(path, ssm.get("layer"))  # before any size or tensor is read
    cfg, sd, f = load_w4(path)
    dims, plan = parse_config(path, cfg, w4_plan)
    recipe = plan[0][0][0]
    norm = layer_kind(path, cfg, "norm", "norm_cfg", _NORM[recipe])
    if norm != _NORM[recipe]:
        raise _refuse(path, f"norm_cfg.norm {norm!r} with {recipe}QMamba2")
    kinds = w4_head_kinds(path, cfg, recipe, _refuse)
    check_w4_top(path, f, sd, dims, kinds, recipe, SUPPORTED_W4)
    dims, blocks = check_w4_blocks(path, cfg, sd, f)
    return Quamba2W4Checkpoint(path, cfg, sd, dims, kinds, [layer[recipe] for layer in blocks])
