"""Text -> token ids: the test sample and the calibration windows.

A text file is JSON lines (one document per line, {"text": ...}; the shipped
splits) or plain text (the whole file is one document). Documents are tokenized
separately and joined with the tokenizer's end-of-text token when it has one.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .loading import Tokenizer

__all__ = ["DataError", "TokenText", "read_documents", "tokenize_file", "test_sample", "calibration_windows",
           "DATA_DIR", "DEFAULT_TEXT_FILE", "DEFAULT_CALIB_FILE"]

DATA_DIR = Path(__file__).resolve().parent.parent / "data" / "shakespeare"
DEFAULT_TEXT_FILE = DATA_DIR / "heldout.jsonl"
DEFAULT_CALIB_FILE = DATA_DIR / "calib.jsonl"


class DataError(ValueError):
    """A text file is missing, malformed or too short; the message says how much was available."""


@dataclass
class TokenText:
    """A tokenized text file: the joined id stream and where it came from."""

    path: Path
    sha256: str
    n_documents: int
    ids: torch.Tensor  # (n_tokens,) int64


def read_documents(path: Path) -> list[str]:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read text file {path}: {e.strerror}") from None
    text = raw.decode("utf-8", errors="strict") if raw else ""
    if path.suffix.lower() not in (".jsonl", ".json"):
        return [text] if text.strip() else []
    docs = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            docs.append(item["text"] if isinstance(item, dict) else str(item))
        except (json.JSONDecodeError, KeyError) as e:
            raise DataError(f"{path}:{n}: not a JSON object with a 'text' field ({e})") from None
    return docs


def tokenize_file(tokenizer: Tokenizer, path: Path) -> TokenText:
    path = Path(path)
    docs = read_documents(path)
    ids: list[int] = []
    for doc_ids in tokenizer.encode_documents(docs):
        ids.extend(doc_ids)
        if tokenizer.eos_id is not None:
            ids.append(tokenizer.eos_id)
    return TokenText(path, hashlib.sha256(path.read_bytes()).hexdigest(), len(docs), torch.tensor(ids, dtype=torch.int64))


def test_sample(text: TokenText, seq_len: int) -> torch.Tensor:
    """The first seq_len tokens: (1, seq_len) int64."""
    if seq_len <= 0:
        raise DataError(f"--seq_len must be a positive number of tokens, got {seq_len}")
    if len(text.ids) < seq_len:
        raise DataError(f"{text.path} gives only {len(text.ids)} tokens with this tokenizer, fewer than "
                        f"--seq_len {seq_len}; use a shorter --seq_len or a longer --text_file")
    return text.ids[:seq_len].unsqueeze(0)


def calibration_windows(text: TokenText, num: int, seqlen: int, seed: int) -> torch.Tensor:
    """`num` distinct non-overlapping windows of `seqlen` tokens, drawn in a seeded order: (num, seqlen) int64.

    Like Quamba's shuffled calibration set (seed 42), but of equal length so samples batch.
    """
    if num <= 0 or seqlen <= 0:
        raise DataError(f"--calib_data_num and --calib_seqlen must be positive, got {num} and {seqlen}")
    available = len(text.ids) // seqlen
    if num > available:
        raise DataError(f"{text.path} gives {len(text.ids)} tokens, i.e. {available} calibration samples of "
                        f"{seqlen} tokens; --calib_data_num {num} is too many (use at most {available}, "
                        f"a shorter --calib_seqlen, or a longer --calib_file)")
    order = torch.randperm(available, generator=torch.Generator().manual_seed(seed))[:num]
    return text.ids[: available * seqlen].view(available, seqlen)[order]
