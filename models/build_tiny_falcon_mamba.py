"""Rebuild `models/falcon-mamba-tiny` from the shipped Shakespeare text, deterministically.

    .venv/bin/python models/build_tiny_falcon_mamba.py                       # full build
    .venv/bin/python models/build_tiny_falcon_mamba.py --steps 5 --out /tmp/t   # smoke run

A Falcon-Mamba (transformers `FalconMambaForCausalLM`: Mamba-1 blocks with weightless RMSNorms on dt, B and C),
the size of mamba-tiny. Trained as models/build_tiny_mamba2.py trains mamba2-tiny (same data, windows, tokenizer,
optimiser, schedule and seed; its ``train`` loop), with transformers' own torch path in eval mode. The held-out
loss before and after training is measured with transformers' forward and written to training_report.json.
Same machine type, thread count and library versions give the same files.
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
D_MODEL   = 192   # as mamba-tiny: 12 * 16 (d_inner 384)
N_LAYER   = 4
D_STATE   = 16
# fmt: on


def falcon_config(vocab: int, eos: int):
    from transformers import FalconMambaConfig

    return FalconMambaConfig(vocab_size=vocab, hidden_size=D_MODEL, num_hidden_layers=N_LAYER, state_size=D_STATE,
                             expand=2, conv_kernel=4, tie_word_embeddings=True, use_mambapy=False,
                             pad_token_id=eos, bos_token_id=eos, eos_token_id=eos)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "models" / "falcon-mamba-tiny")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; results are reproducible for a fixed value")
    args = parser.parse_args(argv)

    from tokenizers import Tokenizer
    from transformers import FalconMambaForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.time()
    tok = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    train_stream = tiny.encode(tok, tiny.read_docs("train"))
    heldout_stream = tiny.encode(tok, tiny.read_docs("heldout"))
    eos = tok.token_to_id(tiny.EOS)
    model = FalconMambaForCausalLM(falcon_config(tok.get_vocab_size(), eos)).eval()
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
