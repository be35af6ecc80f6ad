"""Rebuild `models/falcon-mamba-tiny` from the shipped Shakespeare text, deterministically.

    .venv/bin/python models/build_tiny_falcon_mamba.py                       # full build
    .venv/bin/python models/build_tiny_falcon_mamba.py --steps 5 --out /tmp/t   # smoke run

A Falcon-Mamba (transformers `FalconMambaForCausalLM`: Mamba-1 blocks with weightless RMSNorms on dt, B and C),
the size of mamba-tiny, with mamba-tiny's tokenizer, data, windows, optimiser, schedule and seed. transformers'
Falcon-Mamba torch path trains at about 2 minutes a step on a 2-core CPU (its sequential scan under autograd), so
the weights are trained in mamba-tiny's twin (models/build_tiny_model.py `TrainLM`: the same parameter names and
math, a scan with a hand-written backward; given `mixer_rms_eps` it applies Falcon-Mamba's norms), then copied
back into `FalconMambaForCausalLM`; `--check` asserts the twin's logits equal transformers' within 1e-5 first.
The held-out loss before and after training is measured with transformers' forward and written to
training_report.json. Same machine type, thread count and library versions give the same files.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_tiny_model as tiny  # noqa: E402  (data, windows, loss, schedule and the training twin)
import build_tiny_mamba2 as tiny2  # noqa: E402  (the build command)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = tiny.ROOT

# fmt: off
D_MODEL   = 192   # as mamba-tiny: 12 * 16 (d_inner 384, dt_rank 12)
N_LAYER   = 3     # as mamba-tiny: model.safetensors about 6 MB in fp32
D_STATE   = 16
STEPS     = 300
# fmt: on


def falcon_config(vocab: int, eos: int):
    from transformers import FalconMambaConfig

    return FalconMambaConfig(vocab_size=vocab, hidden_size=D_MODEL, num_hidden_layers=N_LAYER, state_size=D_STATE,
                             expand=2, conv_kernel=4, tie_word_embeddings=True, use_mambapy=False,
                             pad_token_id=eos, bos_token_id=eos, eos_token_id=eos)


def twin_of(hf_model) -> tiny.TrainLM:
    """mamba-tiny's training twin with `hf_model`'s weights (and its config's mixer_rms_eps)."""
    twin = tiny.TrainLM(hf_model.config)
    missing, unexpected = twin.load_state_dict(hf_model.state_dict(), strict=False)
    assert set(missing) == set() and set(unexpected) <= {"lm_head.weight"}, (missing, unexpected)
    return twin


def twin_gap(hf_model, twin: tiny.TrainLM, ids: torch.Tensor) -> float:
    """Relative L2 distance of the twin's logits from transformers' FalconMambaForCausalLM's on `ids`."""
    with torch.no_grad():
        ref = hf_model(input_ids=ids).logits.double()
        got = twin(ids).double()
    return float((got - ref).norm() / ref.norm())


def train_in_twin(hf_model, stream: torch.Tensor, steps: int, seed: int) -> None:
    """Train `hf_model`'s weights in the twin with mamba-tiny's loop, then copy them back (tied head re-tied)."""
    twin = twin_of(hf_model)
    probe = stream[: 2 * tiny.SEQ_LEN].view(2, tiny.SEQ_LEN)
    gap = twin_gap(hf_model, twin, probe)
    print(f"twin vs FalconMambaForCausalLM before training: relative L2 {gap:.2e}")
    assert gap <= 1e-5, gap
    tiny.train(twin.train(), stream, steps, seed)
    hf_model.load_state_dict(twin.state_dict(), strict=False)
    hf_model.tie_weights()
    gap = twin_gap(hf_model, twin.eval(), probe)
    print(f"twin vs FalconMambaForCausalLM after training: relative L2 {gap:.2e}")
    assert gap <= 1e-5, gap


def main(argv: list[str] | None = None) -> int:
    def make_model(vocab: int, eos: int):
        from transformers import FalconMambaForCausalLM
        return FalconMambaForCausalLM(falcon_config(vocab, eos))
    return tiny2.build(argv, __doc__.splitlines()[0], ROOT / "models" / "falcon-mamba-tiny", STEPS, make_model,
                       train_in_twin)


if __name__ == "__main__":
    sys.exit(main())
