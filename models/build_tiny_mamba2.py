"""Rebuild `models/mamba2-tiny` from the shipped Shakespeare text, deterministically.

    .venv/bin/python models/build_tiny_mamba2.py                       # full build
    .venv/bin/python models/build_tiny_mamba2.py --steps 5 --out /tmp/t   # smoke run

As models/build_tiny_model.py builds mamba-tiny (same data, windows, optimiser and schedule, and the
same byte-level BPE tokenizer: mamba-tiny's tokenizer.json, trained on the training split), but the
model is a transformers `Mamba2ForCausalLM` trained directly: its torch path (the chunked SSD,
modeling_mamba2.py:257-370) is differentiable and fast enough on a CPU at this size. The held-out loss
before and after training is measured with transformers' own forward and written to training_report.json.

Same machine type, same thread count and same library versions give the same files.
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

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = tiny.ROOT
TOKENIZER = ROOT / "models" / "mamba-tiny"

# fmt: off
D_MODEL   = 192   # as mamba-tiny: 12 * 16
N_LAYER   = 3
HEADDIM   = 32    # d_inner 384 = 12 heads * 32
NGROUPS   = 2     # more than one SSD group: B, C and the gated norm are group-wise
D_STATE   = 16
CHUNK     = 64    # a 256-token window has 4 chunks
# fmt: on


def mamba2_config(vocab: int, eos: int):
    from transformers import Mamba2Config

    return Mamba2Config(vocab_size=vocab, hidden_size=D_MODEL, num_hidden_layers=N_LAYER, state_size=D_STATE,
                        expand=2, num_heads=2 * D_MODEL // HEADDIM, head_dim=HEADDIM, n_groups=NGROUPS,
                        chunk_size=CHUNK, conv_kernel=4, tie_word_embeddings=True,
                        pad_token_id=eos, bos_token_id=eos, eos_token_id=eos)


def train(model, stream: torch.Tensor, steps: int, seed: int) -> None:
    """tiny.train's loop on a Mamba2ForCausalLM (kept in eval mode: it has no dropout, and train mode
    would ask for the fused CUDA kernels)."""
    gen = torch.Generator().manual_seed(seed)
    named = list(model.named_parameters())
    decay = [p for n, p in named if p.dim() >= 2 and "embeddings" not in n]
    no_decay = [p for n, p in named if not (p.dim() >= 2 and "embeddings" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=tiny.LR, betas=(0.9, 0.95))
    start = time.time()
    for step in range(steps):
        starts = torch.randint(0, len(stream) - tiny.SEQ_LEN - 1, (tiny.BATCH,), generator=gen)
        ids = torch.stack([stream[s:s + tiny.SEQ_LEN] for s in starts.tolist()])
        for group in opt.param_groups:
            group["lr"] = tiny.lr_at(step, steps)
        loss = tiny.lm_loss(model(input_ids=ids).logits, ids)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"  step {step:4d}/{steps}  train loss {loss.item():.4f}  ({time.time() - start:.0f}s)", flush=True)


def build(argv: list[str] | None, description: str, default_out: Path, default_steps: int, make_model,
          trainer=train) -> int:
    """The command line of a tiny model's build: `make_model(vocab, eos)` (a transformers model), trained on the
    shipped text by `trainer(model, stream, steps, seed)` (this file's loop unless given), saved with the tokenizer
    and a training report. Shared by the Mamba-2, Bamba and Falcon-Mamba builds (models/build_tiny_*.py)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, default=default_out)
    parser.add_argument("--steps", type=int, default=default_steps)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; results are reproducible for a fixed value")
    args = parser.parse_args(argv)

    from tokenizers import Tokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.time()
    tok = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    train_stream = tiny.encode(tok, tiny.read_docs("train"))
    heldout_stream = tiny.encode(tok, tiny.read_docs("heldout"))
    eos = tok.token_to_id(tiny.EOS)
    model = make_model(tok.get_vocab_size(), eos).eval()
    loss_start = tiny.heldout_loss(model, heldout_stream)
    print(f"held-out loss before training: {loss_start:.4f} (ln vocab = {math.log(tok.get_vocab_size()):.4f})")
    trainer(model, train_stream, args.steps, args.seed)
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


def main(argv: list[str] | None = None) -> int:
    def make_model(vocab: int, eos: int):
        from transformers import Mamba2ForCausalLM
        return Mamba2ForCausalLM(mamba2_config(vocab, eos))
    return build(argv, __doc__.splitlines()[0], ROOT / "models" / "mamba2-tiny", 500, make_model)


if __name__ == "__main__":
    sys.exit(main())
