"""Rebuild `models/bamba-tiny` from the shipped Shakespeare text, deterministically.

    .venv/bin/python models/build_tiny_bamba.py                       # full build
    .venv/bin/python models/build_tiny_bamba.py --steps 5 --out /tmp/t   # smoke run

A hybrid in the Bamba / Granite 4.0-H layout (transformers `BambaForCausalLM`): three decoder layers, Mamba-2
mixers in layers 0 and 2 and attention in layer 1, each followed by a SiLU-gated MLP. Trained as
models/build_tiny_mamba2.py trains mamba2-tiny (same data, windows, tokenizer, optimiser, schedule and seed; its
``train`` loop), with transformers' own torch path in eval mode (no dropout; train mode would ask for the fused
CUDA kernels). The held-out loss before and after training is measured with transformers' forward and written
to training_report.json. Same machine type, thread count and library versions give the same files.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_tiny_model as tiny  # noqa: E402  (data, windows, loss and schedule shared with mamba-tiny)
import build_tiny_mamba2 as tiny2  # noqa: E402  (the training loop and the build command)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = tiny.ROOT

# fmt: off
D_MODEL   = 192   # as mamba-tiny: 12 * 16
N_LAYER   = 3     # decoder layers: Mamba-2, attention, Mamba-2 (each with its MLP): 6 harness blocks
ATTN      = [1]
D_FF      = 384
HEADS     = 6     # attention: head_dim 32, grouped-query with 2 key/value heads
KV_HEADS  = 2
M_HEADS   = 12    # Mamba-2: d_inner 384 = 12 heads * 32
NGROUPS   = 2
D_STATE   = 16
CHUNK     = 64    # a 256-token window has 4 chunks
# fmt: on


def bamba_config(vocab: int, eos: int):
    from transformers import BambaConfig

    cfg = BambaConfig(vocab_size=vocab, hidden_size=D_MODEL, intermediate_size=D_FF, num_hidden_layers=N_LAYER,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, attn_layer_indices=ATTN,
                      mamba_n_heads=M_HEADS, mamba_d_head=2 * D_MODEL // M_HEADS, mamba_n_groups=NGROUPS,
                      mamba_d_state=D_STATE, mamba_chunk_size=CHUNK, tie_word_embeddings=True,
                      pad_token_id=eos, bos_token_id=eos, eos_token_id=eos)
    cfg._attn_implementation = "eager"
    return cfg


def main(argv: list[str] | None = None) -> int:
    def make_model(vocab: int, eos: int):
        from transformers import BambaForCausalLM
        return BambaForCausalLM(bamba_config(vocab, eos))
    return tiny2.build(argv, __doc__.splitlines()[0], ROOT / "models" / "bamba-tiny", 200, make_model)


if __name__ == "__main__":
    sys.exit(main())
