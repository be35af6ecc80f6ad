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

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_tiny_model as tiny  # noqa: E402  (data, windows, loss and schedule shared with mamba-tiny)
import build_tiny_mamba2 as tiny2  # noqa: E402  (the training loop)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = tiny.ROOT
TOKENIZER = ROOT / "models" / "mamba-tiny"

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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "models" / "bamba-tiny")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; results are reproducible for a fixed value")
    args = parser.parse_args(argv)

    from tokenizers import Tokenizer
    from transformers import BambaForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.time()
    tok = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    train_stream = tiny.encode(tok, tiny.read_docs("train"))
    heldout_stream = tiny.encode(tok, tiny.read_docs("heldout"))
    eos = tok.token_to_id(tiny.EOS)
    model = BambaForCausalLM(bamba_config(tok.get_vocab_size(), eos)).eval()
    loss_start = tiny.heldout_loss(model, heldout_stream)
    print(f"held-out loss before training: {loss_start:.4f} (ln vocab = {math.log(tok.get_vocab_size()):.4f})")
    tiny2.train(model, train_stream, args.steps, args.seed)
    loss_end = tiny.heldout_loss(model, heldout_stream)
    print(f"held-out loss after training:  {loss_end:.4f}")

    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TOKENIZER / name, args.out / name)
    report = {"loss_untrained": round(loss_start, 4), "loss_trained": round(loss_end, 4),
              "eval_tokens": tiny.EVAL_WINDOWS * tiny.SEQ_LEN, "steps": args.steps, "seed": args.seed,
              "threads": args.threads, "seconds": round(time.time() - t0)}
    (args.out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
