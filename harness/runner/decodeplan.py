"""The pipeline's pieces for ``--decode N`` and ``--generate N`` (runner.decode, runner.generate): the checks of
the options, the sample's tokens (the prompt and the N tokens the steps are fed), the SSM state scales the steps
re-quantize at (the calibration's provenance), and the generated ids as text."""
from __future__ import annotations

from ..checkpoints.text import DataError, ShortText, read_sample
from .config import RunConfig, RunError

__all__ = ["MAX_GENERATE", "check_decode", "generated_text", "read_text", "state_scales"]

MAX_GENERATE = 100_000  # --generate N at most: a step of the whole model per token and mode (on the shipped model
                        # about 10 ms each on the 2-core machine), every token's text in the stats


def state_scales(scales: list) -> list | None:
    """Per layer the SSM state scale a decode step re-quantizes at: Quamba1's s_h, Quamba2's ssm_state_scale
    table (W4A8: that of the W8A8 scales it shares); None for W4A16 (no scales, an fp16 state)."""
    tables = [getattr(s, "scales", s) for s in scales]    # Q2W4Layer -> its W8A8 scales (None for W4A16)
    if any(t is None for t in tables):
        return None
    has = [hasattr(t, "s_h") or hasattr(t, "ssm_state_scale") for t in tables]
    if not any(has):
        return None  # a recipe whose statistics hold no state scale (the field's recipes: docs/field-recipes.md)
    return [t.s_h if hasattr(t, "s_h") else t.ssm_state_scale.tolist() if hasattr(t, "ssm_state_scale") else None
            for t in tables]  # None: a hybrid's attention or MLP block (no SSM state)


def check_decode(cfg: RunConfig) -> None:
    """--decode N: one sample, a fresh file, on the CPU (runner.decode)."""
    if cfg.decode < 0:
        raise RunError(f"--decode must be a positive number of steps, got {cfg.decode}")
    if cfg.generate < 0:
        raise RunError(f"--generate must be a positive number of tokens, got {cfg.generate}")
    if cfg.generate > MAX_GENERATE:
        raise RunError(f"--generate {cfg.generate} is more than the {MAX_GENERATE} tokens a run generates at most "
                       f"(one forward step of the whole model per token and mode, each token kept in the stats); "
                       f"use --generate 1..{MAX_GENERATE}")
    if (cfg.decode or cfg.generate) and (cfg.samples > 1 or cfg.resume or cfg.device != "cpu"):
        raise RunError("--decode and --generate run one sample (--samples 1) on the CPU into a new file: they do "
                       "not combine with --samples > 1, --resume or --device cuda yet")


def generated_text(modes: dict, tok, reference: str) -> None:
    """--generate: each mode's generated ids as text, beside the reference's (the report shows both)."""
    ref = modes.get(reference, {}).get("generate")
    for entry in modes.values():
        gen = entry.get("generate")
        if gen is not None:
            gen["text"] = tok.tok.decode(gen["ids"])
            gen["tokens"] = [tok.tok.decode([i]) for i in gen["ids"]]
            if ref is not None:
                gen["reference_text"] = tok.tok.decode(ref["ids"])


def read_text(tok, cfg: RunConfig):
    """The sample: seq_len * samples tokens, or with --decode N the prompt and the N tokens the steps are fed."""
    if not cfg.decode:
        return read_sample(tok, cfg.text_file, cfg.seq_len * cfg.samples)
    try:
        return read_sample(tok, cfg.text_file, cfg.seq_len + cfg.decode)
    except ShortText as e:
        raise DataError(_too_short(cfg, e.tokens)) from None


def _too_short(cfg: RunConfig, tokens: int) -> str:
    """Why the text is too short for --decode N: the steps are fed the N tokens after the prompt."""
    room = tokens - cfg.seq_len
    fix = (f"a smaller --decode (at most {room} with --seq_len {cfg.seq_len}), a shorter --seq_len"
           if room > 0 else "a shorter --seq_len")
    return (f"--decode {cfg.decode} needs --seq_len {cfg.seq_len} + {cfg.decode} = {cfg.seq_len + cfg.decode} "
            f"tokens of {cfg.text_file} (--decode N adds N tokens: the prompt's --seq_len tokens, then one more per "
            f"step), but it gives only {tokens} with this tokenizer; use {fix} or a longer --text_file")
