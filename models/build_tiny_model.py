"""Rebuild `models/mamba-tiny` from the shipped Shakespeare text, deterministically.

    .venv/bin/python models/build_tiny_model.py            # full build (about 10 minutes)
    .venv/bin/python models/build_tiny_model.py --steps 5 --out /tmp/t   # smoke run

Steps:
  1. train a byte-level BPE tokenizer (vocab 4096) on data/shakespeare/train.jsonl;
  2. initialise a transformers `MambaForCausalLM` (seeded) and copy its weights into
     a compact training twin that has the same parameter names and the same math,
     but a scan with a hand-written backward (transformers' reference scan needs
     about a minute per step on a 2-core CPU, almost all of it in autograd);
  3. train on random 256-token windows of the training split;
  4. copy the weights back into `MambaForCausalLM`, measure the held-out loss with
     transformers itself (before and after training) and save with `save_pretrained`
     (safetensors) plus the tokenizer.

Same machine type, same thread count and same library versions give the same files.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data" / "shakespeare"
EOS = "<|endoftext|>"

# fmt: off
VOCAB_SIZE  = 4096   # a few thousand byte-level BPE merges: ~3.1 chars per token here
D_MODEL     = 192    # 12 * 16, so the rotation uses the same H12 kernel as mamba-130m (768 = 12 * 64)
N_LAYER     = 3      # keeps model.safetensors near 6 MB in fp32
SEQ_LEN     = 256    # training window
BATCH       = 8
LR          = 3e-3
WARMUP      = 50
EVAL_WINDOWS = 64    # held-out windows of SEQ_LEN tokens for the reported loss
# fmt: on


def read_docs(split: str) -> list[str]:
    with open(DATA / f"{split}.jsonl", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def train_tokenizer(docs: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer)
    return tok


def encode(tok, docs: list[str]) -> torch.Tensor:
    """Documents joined by the end-of-text token, as one int64 stream."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)


class _ScanFn(torch.autograd.Function):
    """h_t = dA_t * h_{t-1} + dBu_t over dim 1, returning every h_t; h_{-1} = 0.

    dA, dBu: (batch, seqlen, d_inner, d_state) fp32. Backward runs the adjoint
    recurrence g_t = grad_t + dA_{t+1} * g_{t+1} in one loop, so autograd never
    sees the per-step indexing that makes transformers' loop slow to train.
    """

    @staticmethod
    def forward(ctx, dA, dBu):
        states = torch.empty_like(dBu)
        h = torch.zeros_like(dBu[:, 0])
        for t in range(dBu.shape[1]):
            h = dA[:, t] * h + dBu[:, t]
            states[:, t] = h
        ctx.save_for_backward(dA, states)
        return states

    @staticmethod
    def backward(ctx, grad_states):
        dA, states = ctx.saved_tensors
        seqlen = grad_states.shape[1]
        adj = torch.empty_like(grad_states)
        g = torch.zeros_like(grad_states[:, 0])
        for t in range(seqlen - 1, -1, -1):
            g = grad_states[:, t] + (dA[:, t + 1] * g if t + 1 < seqlen else 0)
            adj[:, t] = g
        prev = torch.cat([torch.zeros_like(states[:, :1]), states[:, :-1]], dim=1)
        return adj * prev, adj


class TrainMixer(nn.Module):
    """The transformers MambaMixer math (slow path) with the fast-backward scan; with `mixer_rms_eps`,
    FalconMambaMixer's (the same plus weightless RMSNorms on dt, B and C)."""

    def __init__(self, d_model: int, d_inner: int, d_state: int, d_conv: int, dt_rank: int,
                 mixer_rms_eps: float | None = None):
        super().__init__()
        self.d_inner, self.d_state, self.dt_rank = d_inner, d_state, dt_rank
        self.mixer_rms_eps = mixer_rms_eps  # Falcon-Mamba's weightless RMSNorms on dt, B, C; None: plain Mamba-1
        self.in_proj = nn.Linear(d_model, 2 * d_inner, bias=False)
        self.conv1d = nn.Conv1d(d_inner, d_inner, d_conv, groups=d_inner, padding=d_conv - 1)
        self.x_proj = nn.Linear(d_inner, dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(dt_rank, d_inner, bias=True)
        self.A_log = nn.Parameter(torch.zeros(d_inner, d_state))
        self.D = nn.Parameter(torch.ones(d_inner))
        self.out_proj = nn.Linear(d_inner, d_model, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        seqlen = hidden_states.shape[1]
        # fmt: off
        x, gate = self.in_proj(hidden_states).chunk(2, dim=-1)                  # [batch, seqlen, d_inner] each
        x = F.silu(self.conv1d(x.transpose(1, 2))[..., :seqlen]).transpose(1, 2)
        time_step, B, C = torch.split(self.x_proj(x), [self.dt_rank, self.d_state, self.d_state], dim=-1)
        if self.mixer_rms_eps is not None:
            time_step, B, C = (self._weightless_rms(t) for t in (time_step, B, C))
        delta = F.softplus(time_step @ self.dt_proj.weight.t() + self.dt_proj.bias)  # [batch, seqlen, d_inner]
        A = -torch.exp(self.A_log)                                               # [d_inner, d_state]
        dA = torch.exp(delta[..., None] * A)                                     # [batch, seqlen, d_inner, d_state]
        dBu = (delta * x)[..., None] * B[:, :, None, :]                          # same product, one broadcast
        states = _ScanFn.apply(dA, dBu)
        y = torch.einsum("blen,bln->ble", states, C) + x * self.D                # [batch, seqlen, d_inner]
        # fmt: on
        return self.out_proj(y * F.silu(gate))

    def _weightless_rms(self, t: torch.Tensor) -> torch.Tensor:
        """FalconMambaWeightlessRMSNorm over the part's own width, applied after the x_proj split and before
        dt_proj (transformers 5.23 models/falcon_mamba/modeling_falcon_mamba.py:53-57, 466-469)."""
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + self.mixer_rms_eps)


class TrainRMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


class TrainBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.norm = TrainRMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.mixer = TrainMixer(cfg.hidden_size, cfg.intermediate_size, cfg.state_size,
                                cfg.conv_kernel, int(cfg.time_step_rank), getattr(cfg, "mixer_rms_eps", None))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mixer(self.norm(h))


class TrainBackbone(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(TrainBlock(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm_f = TrainRMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)


class TrainLM(nn.Module):
    """Parameter names equal MambaForCausalLM's (and FalconMambaForCausalLM's), so state dicts copy both ways."""

    def __init__(self, cfg):
        super().__init__()
        self.backbone = TrainBackbone(cfg)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.backbone.embeddings(ids)
        for layer in self.backbone.layers:
            h = layer(h)
        return self.backbone.norm_f(h) @ self.backbone.embeddings.weight.t()  # tied lm_head


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


@torch.no_grad()
def heldout_loss(hf_model, stream: torch.Tensor) -> float:
    """Mean next-token loss of transformers' own forward on the first EVAL_WINDOWS windows."""
    n = min(EVAL_WINDOWS, (len(stream) - 1) // SEQ_LEN)
    windows = stream[: n * SEQ_LEN].view(n, SEQ_LEN)
    losses = [hf_model(input_ids=w, labels=w).loss.item() for w in windows.split(8)]
    return sum(losses) / len(losses)


def lr_at(step: int, steps: int) -> float:
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    progress = (step - WARMUP) / max(1, steps - WARMUP)
    return LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model: TrainLM, stream: torch.Tensor, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embeddings" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embeddings" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.95))
    start = time.time()
    for step in range(steps):
        starts = torch.randint(0, len(stream) - SEQ_LEN - 1, (BATCH,), generator=gen)
        ids = torch.stack([stream[s:s + SEQ_LEN] for s in starts.tolist()])
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps)
        loss = lm_loss(model(ids), ids)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"  step {step:4d}/{steps}  train loss {loss.item():.4f}  ({time.time() - start:.0f}s)", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "models" / "mamba-tiny")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads; results are reproducible for a fixed value")
    args = parser.parse_args(argv)

    from transformers import MambaConfig, MambaForCausalLM, PreTrainedTokenizerFast

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.time()
    tok = train_tokenizer(read_docs("train"))
    train_stream = encode(tok, read_docs("train"))
    heldout_stream = encode(tok, read_docs("heldout"))
    print(f"tokenizer: vocab {tok.get_vocab_size()}, train {len(train_stream)} tokens, "
          f"held-out {len(heldout_stream)} tokens")

    eos = tok.token_to_id(EOS)
    cfg = MambaConfig(vocab_size=VOCAB_SIZE, hidden_size=D_MODEL, num_hidden_layers=N_LAYER,
                      state_size=16, expand=2, conv_kernel=4, tie_word_embeddings=True,
                      pad_token_id=eos, bos_token_id=eos, eos_token_id=eos)
    hf_model = MambaForCausalLM(cfg).eval()
    loss_start = heldout_loss(hf_model, heldout_stream)
    print(f"held-out loss before training: {loss_start:.4f} (ln vocab = {math.log(VOCAB_SIZE):.4f})")

    model = TrainLM(cfg)
    missing, unexpected = model.load_state_dict(hf_model.state_dict(), strict=False)
    assert set(missing) == set() and set(unexpected) <= {"lm_head.weight"}, (missing, unexpected)
    train(model.train(), train_stream, args.steps, args.seed)

    hf_model.load_state_dict(model.state_dict(), strict=False)
    hf_model.tie_weights()
    loss_end = heldout_loss(hf_model, heldout_stream)
    print(f"held-out loss after training:  {loss_end:.4f}")

    args.out.mkdir(parents=True, exist_ok=True)
    hf_model.save_pretrained(args.out, safe_serialization=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS,
                                   unk_token=EOS, pad_token=EOS)
    fast.save_pretrained(args.out)
    report = {"loss_untrained": round(loss_start, 4), "loss_trained": round(loss_end, 4),
              "eval_tokens": EVAL_WINDOWS * SEQ_LEN, "steps": args.steps, "seed": args.seed,
              "threads": args.threads, "seconds": round(time.time() - t0)}
    (args.out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
