"""Tokenizers from local directories: tokenizer.json, or a byte-level BPE's vocab.json + merges.txt."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from ..store.files import is_regular, read_regular
from .loading import ModelDirError, refuse_in

__all__ = ["Tokenizer", "load_tokenizer"]


class Tokenizer:
    """A `tokenizers` tokenizer plus the id that separates documents (None if it has no end-of-text token)."""

    def __init__(self, tok, path: Path) -> None:
        self.tok, self.path = tok, path
        self.eos_id = next((tok.token_to_id(t) for t in ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
                            if tok.token_to_id(t) is not None), None)

    def encode_documents(self, docs: list[str]) -> list[list[int]]:
        encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)  # no offsets: faster, same ids
        return [enc.ids for enc in encode(docs, add_special_tokens=False)]


def load_tokenizer(model_dir: Path, tokenizer_dir: Path | None = None) -> Tokenizer:
    """tokenizer.json (or vocab.json + merges.txt, byte-level BPE) from tokenizer_dir or the model directory."""
    where = Path(tokenizer_dir) if tokenizer_dir is not None else Path(model_dir)
    if not where.is_dir():
        raise ModelDirError(f"tokenizer directory {where} does not exist; it must contain tokenizer.json "
                            f"(or vocab.json and merges.txt)")
    if is_regular(tok_file := where / "tokenizer.json", refuse_in(tok_file)):
        try:  # read here, then parsed: the file is checked on the descriptor that reads it
            return Tokenizer(HFTokenizer.from_str(read_regular(tok_file, 1 << 30).decode("utf-8")), tok_file)
        except Exception as e:
            raise ModelDirError(f"{tok_file} cannot be read as a tokenizer ({e})") from None
    if all([is_regular(where / n, refuse_in(where / n)) for n in ("vocab.json", "merges.txt")]):
        try:
            tok = HFTokenizer(models.BPE.from_file(str(where / "vocab.json"), str(where / "merges.txt")))
        except Exception as e:
            raise ModelDirError(f"{where}: vocab.json and merges.txt cannot be read as a byte-level BPE tokenizer "
                                f"({e}); vocab.json must map tokens to ids, merges.txt list merges") from None
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        return Tokenizer(tok, where / "vocab.json")
    hint = "" if tokenizer_dir is not None else "; pass --tokenizer DIR to use another directory"
    raise ModelDirError(f"no tokenizer in {where}: it must contain tokenizer.json (or vocab.json and merges.txt){hint}")
