"""MambaQuant's W4A8 (``--use_gptq``, MambaQuant/MambaQuant@a4803c4 model_llm/tests/quant_naive.py:737-761,
quantize/gptq.py:1202-1312): after the transforms, layer by layer, the inputs of the block's linear layers (their
Hessians, emulation.gptq.Hessian) on the calibration windows flowing through the layers already quantized, with
the activation quantizers on; then GPTQ with one symmetric 4-bit scale per output row found by the MSE search
(emulation.gptq_channel). in_proj's two halves and x_proj's three slices share their input, so GPTQ of the
stacked weight is GPTQ of each (per-row scales). conv1d (and the release's lm_head, which the harness keeps fp)
stay asymmetric percentile RTN at 4 bits. As written, GPTQ starts from the weights the release's first forward
already quantized (asymmetric RTN, before the transforms: the notes §4.5); as meant, from the transformed fp
weights."""
from __future__ import annotations

import torch

from ...architectures.registry import get_architecture
from ...emulation.gptq import Hessian
from ...emulation.gptq_channel import gptq_channel
from .blocks import LINEARS, MQ_POINTS, act_quantizer, fold_layer, rotations, setup_layer, weight_rtn

__all__ = ["gptq_layers"]

_INPUT_OF = {"in_proj": "in_proj", "x_proj": "x_proj", "dt_proj": "dt_proj", "out_proj": "out_proj"}


class _Tap:
    """A point's activation quantizer that adds its (unquantized) input to a Hessian first."""

    def __init__(self, hess: Hessian | None, quantize) -> None:
        self.hess, self.quantize = hess, quantize

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.hess is not None:
            for seq in x:  # one sequence per add, as the release's loop over samples (gptq.py:1290-1292)
                self.hess.add(seq[None])
        return self.quantize(x)


def _start(bank, stats, i: int, opts: dict, block) -> dict[str, torch.Tensor]:
    """The weights GPTQ starts from: the transformed fp weights, or as written the RTN'd ones transformed."""
    if opts["upstream"] != "as-written":
        return block.folded
    from dataclasses import replace
    p = bank.layer(i, "fp32", False, "exact")
    early = replace(p, **{n: weight_rtn(getattr(p, n), opts["bits"], "mambaquant") for n in LINEARS})
    return fold_layer(early, stats[i], rotations(stats, i, bank.dims, opts["seed"], True), bank.dims)


def gptq_layers(mode, bank, windows: torch.Tensor, batch_size: int, depth: int, stats: list[dict],
                opts: dict) -> list[dict[str, torch.Tensor]]:
    """Per layer 0..depth {"gptq_<linear>": the GPTQ'd weight}, sequentially."""
    arch = get_architecture("mamba1")
    residuals = [bank.embed(b, False, torch.float32, "exact", "fp32") for b in windows.split(batch_size)]
    out = []
    for i in range(depth + 1):
        block = arch.build_blocks(mode, bank, None, i, False)[i]
        sizes = {"in_proj": bank.dims.d_model, "x_proj": bank.dims.d_inner, "dt_proj": bank.dims.dt_rank,
                 "out_proj": bank.dims.d_inner}
        hess = {n: Hessian(sizes[n]) for n in LINEARS}
        taps = {n: _Tap(hess.get(n), act_quantizer("mambaquant", None, n, None)) for n in MQ_POINTS}
        setup_layer(block, bank, stats, i, {**opts, "quantizer": "none"}, observer=taps)
        start = _start(bank, stats, i, opts, block)
        for r in residuals:
            block(r)
        weights = {n: gptq_channel(start[n], hess[n].H, opts["bits"]) for n in LINEARS}
        out.append({f"gptq_{n}": w for n, w in weights.items()})
        block = arch.build_blocks(mode, bank, None, i, False)[i]
        setup_layer(block, bank, stats, i, opts, weights=weights)
        residuals = [block(r)[1] for r in residuals]
    return out
