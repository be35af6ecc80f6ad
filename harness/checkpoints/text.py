"""Text -> token ids: the test sample and the calibration windows.

A text file is JSON lines (one document per line, {"text": ...}; the shipped
splits) or plain text (the whole file is one document). Documents are tokenized
separately and joined with the tokenizer's end-of-text token when it has one.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from ..store.files import file_sha256, open_regular
from .tokenizer import Tokenizer

__all__ = ["DataError", "ShortText", "TokenText", "read_documents", "tokenize_file", "read_sample", "calibration_windows",
           "DATA_DIR", "DEFAULT_TEXT_FILE", "DEFAULT_CALIB_FILE", "check_token_ids", "capped", "chars_for"]

DATA_DIR = Path(__file__).resolve().parents[2] / "data" / "shakespeare"  # the repository root
DEFAULT_TEXT_FILE = DATA_DIR / "heldout.jsonl"
DEFAULT_CALIB_FILE = DATA_DIR / "calib.jsonl"
MAX_TEXT_BYTES = 1 << 30  # a text file larger than 1 GiB is refused before it is read


class DataError(ValueError):
    """A text file is missing, malformed or too short; the message says how much was available."""


class ShortText(DataError):
    """The text gives fewer tokens than asked for: `tokens`, how many it gives."""

    def __init__(self, message: str, tokens: int) -> None:
        super().__init__(message)
        self.tokens = tokens


@dataclass
class TokenText:
    """Token ids drawn from a text file, and where they came from."""

    path: Path
    sha256: str
    n_documents: int      # documents in the file
    documents_used: int   # documents tokenized to get `ids`
    ids: torch.Tensor     # (batch, seqlen) int64


_SURROGATE = re.compile("[\ud800-\udfff]")  # a lone surrogate: JSON can escape one, UTF-8 cannot hold it
_WORD_END = re.compile(r"\S(?=\s)")


def _check_text(path: Path, line: int, doc: str) -> None:
    if (m := _SURROGATE.search(doc)) is not None:
        raise DataError(f"{path}:{line}: holds a lone surrogate (U+{ord(m.group()):04X}, from a JSON escape such as "
                        f"\\ud800), which is not text; give valid Unicode")


def _not_utf8(path: Path, raw: bytes, e: UnicodeDecodeError) -> DataError:
    line = raw.count(b"\n", 0, e.start) + 1
    return DataError(f"text file {path} is not UTF-8 (line {line}, byte {e.start}: {e.reason}); "
                     f"give a UTF-8 text or JSON-lines file")


def read_documents(path: Path) -> list[str]:
    """The documents of a text file; a regular UTF-8 file of at most MAX_TEXT_BYTES (checked on the opened
    file before reading: a FIFO or a device is refused, never read)."""
    path = Path(path)
    try:
        with open_regular(path, lambda what: DataError(f"text file {path} is {what}; give a UTF-8 text or "
                                                       f"JSON-lines file")) as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_TEXT_BYTES:
                raise DataError(f"text file {path} has {size} bytes; at most {MAX_TEXT_BYTES} are read")
            raw = f.read(MAX_TEXT_BYTES + 1)
    except OSError as e:
        raise DataError(f"cannot read text file {path}: {e.strerror}") from None
    try:
        text = raw.decode("utf-8", errors="strict") if raw else ""
    except UnicodeDecodeError as e:
        raise _not_utf8(path, raw, e) from None
    if path.suffix.lower() not in (".jsonl", ".json"):
        return [text] if text.strip() else []
    docs = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as e:
            raise DataError(f"{path}:{n}: not a JSON object with a 'text' field ({e})") from None
        doc = item.get("text") if isinstance(item, dict) else item
        if not isinstance(doc, str):
            what = (f"a 'text' field of type {type(doc).__name__}" if isinstance(item, dict) and "text" in item
                    else f"a JSON {type(item).__name__} without a 'text' field")
            raise DataError(f"{path}:{n}: {what}; each line must be a JSON object with a string 'text' field "
                            '(e.g. {"text": "..."}) or a JSON string')
        _check_text(path, n, doc)
        docs.append(doc)
    return docs


def chars_for(tokens: int, tokenizer: Tokenizer) -> int:
    """Characters that give at least `tokens` tokens: a token covers at most as many bytes as the longest
    vocabulary entry (the shipped tokenizer's: 25), and a character is at least one byte."""
    vocab = getattr(getattr(tokenizer, "tok", None), "get_vocab", None)
    if vocab is None:  # a tokenizer whose vocabulary cannot be measured: documents are never cut
        return 1 << 62
    longest = max((len(t.encode("utf-8", "replace")) for t in vocab()), default=1)
    return tokens * max(longest, 1) + 64


def capped(doc: str, need: int) -> str:
    """The start of `doc` that still gives the tokens of its first `need` characters (chars_for), so that a
    huge line is never tokenized whole (a 50 MB line took 4.7 GB in the tokenizer; 200 MB aborted it). The
    cut is made where a word ends and whitespace begins (the pre-tokenizer splits there, so the tokens before
    the cut are those of the whole document), within twice `need` characters, else at twice `need` (a "word"
    that long: its last tokens may differ)."""
    if len(doc) <= 2 * need:
        return doc
    m = _WORD_END.search(doc, need - 1, 2 * need)
    return doc[:m.end() if m is not None else 2 * need]


def _token_stream(tokenizer: Tokenizer, docs: list[str], batch: int = 2) -> Iterator[list[int]]:
    """Each document's ids followed by the end-of-text id; tokenized `batch` documents at a time, lazily
    (each document is encoded on its own either way: the ids do not depend on the batch)."""
    for start in range(0, len(docs), batch):
        for ids in tokenizer.encode_documents(docs[start:start + batch]):
            yield ids + ([tokenizer.eos_id] if tokenizer.eos_id is not None else [])


def tokenize_file(tokenizer: Tokenizer, path: Path) -> torch.Tensor:
    """All documents of a file as one id stream: (n_tokens,) int64."""
    return torch.tensor([i for ids in _token_stream(tokenizer, read_documents(path)) for i in ids], dtype=torch.int64)


def read_sample(tokenizer: Tokenizer, path: Path, seq_len: int) -> TokenText:
    """The first seq_len tokens of the concatenated documents, ids (1, seq_len)."""
    if seq_len <= 0:
        raise DataError(f"--seq_len must be a positive number of tokens, got {seq_len}")
    docs = read_documents(path)
    ids: list[int] = []
    used = 0
    need = chars_for(seq_len, tokenizer)
    for doc_ids in _token_stream(tokenizer, [capped(d, need) for d in docs], batch=1):  # one at a time
        ids += doc_ids
        used += 1
        if len(ids) >= seq_len:
            return TokenText(Path(path), file_sha256(path), len(docs), used,
                             torch.tensor(ids[:seq_len], dtype=torch.int64).unsqueeze(0))
    raise ShortText(f"{path} gives only {len(ids)} tokens with this tokenizer, fewer than --seq_len {seq_len}; "
                    f"use a shorter --seq_len or a longer --text_file", len(ids))


def calibration_windows(tokenizer: Tokenizer, path: Path, num: int, seqlen: int, seed: int) -> TokenText:
    """`num` calibration samples of `seqlen` tokens: ids (num, seqlen).

    Documents are visited in an order shuffled with `seed` (as Quamba shuffles its
    calibration documents with seed 42); each is cut into consecutive windows of
    `seqlen` tokens (its shorter tail is dropped) until `num` windows are collected.
    Only the documents needed are tokenized. Windows never span two documents.
    """
    if num <= 0 or seqlen <= 0:
        raise DataError(f"--calib_data_num and --calib_seqlen must be positive, got {num} and {seqlen}")
    docs = read_documents(path)
    order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(seed)).tolist()
    windows: list[list[int]] = []
    used = 0
    need = chars_for(num * seqlen, tokenizer)
    for doc_ids in _token_stream(tokenizer, [capped(docs[i], need) for i in order]):
        used += 1
        doc_ids = doc_ids[:-1] if tokenizer.eos_id is not None else doc_ids
        windows += [doc_ids[k:k + seqlen] for k in range(0, len(doc_ids) - seqlen + 1, seqlen)]
        if len(windows) >= num:
            return TokenText(Path(path), file_sha256(path), len(docs), used,
                             torch.tensor(windows[:num], dtype=torch.int64))
    raise DataError(f"{path} gives {len(windows)} calibration samples of {seqlen} tokens "
                    f"({len(docs)} documents); --calib_data_num {num} is too many (use at most {len(windows)}, "
                    f"a shorter --calib_seqlen, or a longer --calib_file)")


def check_token_ids(ids: torch.Tensor, vocab_size: int, tokenizer_path) -> None:
    """Token ids beyond the embedding: the tokenizer was made for another model."""
    top = int(ids.max()) if ids.numel() else -1
    if top >= vocab_size:
        raise DataError(f"the tokenizer does not match the model: {tokenizer_path} produced token id {top}, "
                        f"but the model's embedding has {vocab_size} rows (valid ids 0..{vocab_size - 1}); "
                        f"pass --tokenizer DIR with the model's own tokenizer")
