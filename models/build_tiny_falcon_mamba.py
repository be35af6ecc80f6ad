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

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_tiny_model as tiny  # noqa: E402  (data, windows, loss and schedule shared with mamba-tiny)
import build_tiny_mamba2 as tiny2  # noqa: E402  (the training loop and the build command)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = tiny.ROOT

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
    def make_model(vocab: int, eos: int):
        from transformers import FalconMambaForCausalLM
        return FalconMambaForCausalLM(falcon_config(vocab, eos))
    return tiny2.build(argv, __doc__.splitlines()[0], ROOT / "models" / "falcon-mamba-tiny", 200, make_model)


if __name__ == "__main__":
    sys.exit(main())
