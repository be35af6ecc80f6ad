"""Build the local lm-eval tasks' data from the shipped held-out text (data/shakespeare/heldout.jsonl).

lastword.jsonl: {"text": passage}, LAMBADA's layout (lm-eval's lambada_openai reads the same field: the context is
every space-separated word but the last, the target the last word): passages of consecutive lines of the held-out
plays (past their title and list of persons), whitespace collapsed to single spaces, at least MIN_CHARS
characters, cut so that they end on an alphabetic word of at least three letters, not all capitals (a speaker's
name), its trailing punctuation dropped, that appears earlier in the passage (LAMBADA's criterion: the word is
predictable from its context).
rolling.jsonl: {"page": document}, wikitext_document_level's field: the held-out plays (past their front matter)
cut at blank lines into documents of at least DOC_CHARS characters (the rolling perplexity task scores every token
of each).

Deterministic; run from the repository root: python data/lmeval/make_tasks.py
"""
from __future__ import annotations

import json
import re
from pathlib import Path

__all__ = ["lastword_passages", "rolling_documents", "main"]

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "data" / "shakespeare" / "heldout.jsonl"
OUT = Path(__file__).resolve().parent
MIN_CHARS, MAX_CHARS, N_LASTWORD = 240, 1200, 200
DOC_CHARS, N_ROLLING = 1500, 40
SKIP_CHARS = 3000
_LAST = re.compile(r"^(.*\s)([A-Za-z]{3,})[^A-Za-z\s]*$")


def _plays() -> list[str]:
    """The held-out plays, each from its first blank line after SKIP_CHARS (past the title and the list of persons)."""
    texts = [json.loads(line)["text"] for line in SOURCE.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [t[t.index("\n\n", SKIP_CHARS):].lstrip() for t in texts]


def _predictable(passage: str) -> str | None:
    """The passage cut to end on its last word when that word (three letters or more) appears earlier in it, as a
    whole word, case-insensitively (LAMBADA's criterion: the target is predictable from the context)."""
    m = _LAST.match(passage)
    if m is None or len(passage) < MIN_CHARS:
        return None
    word = m.group(2)
    if word.isupper():  # a speaker's name (the plays' "MACBETH."): the play's layout, not its language
        return None
    earlier = {w.lower() for w in re.findall(r"[A-Za-z]+", m.group(1))}
    return m.group(1) + word if word.lower() in earlier else None


def lastword_passages(texts: list[str], n: int) -> list[str]:
    """Up to n passages, taken in turn from each text (so every play contributes); a passage that grows past
    MAX_CHARS without qualifying is dropped."""
    per_text = []
    for text in texts:
        found, lines = [], []
        for line in text.splitlines():
            if line.strip():
                lines.append(line.strip())
            passage = " ".join(" ".join(lines).split())
            if (kept := _predictable(passage)) is not None:
                found.append(kept)
                lines = []
            elif len(passage) > MAX_CHARS:
                lines = []
        per_text.append(found)
    out = []
    for k in range(max(len(f) for f in per_text)):
        out += [f[k] for f in per_text if k < len(f)]
    return out[:n]


def rolling_documents(texts: list[str], n: int) -> list[str]:
    """Up to n documents of whole paragraphs, taken in turn from each text."""
    per_text = []
    for text in texts:
        docs, cur = [], []
        for para in re.split(r"\n\s*\n", text):
            if para.strip():
                cur.append(para.strip())
            if sum(len(p) for p in cur) >= DOC_CHARS:
                docs.append("\n\n".join(cur))
                cur = []
        per_text.append(docs)
    out = []
    for k in range(max(len(d) for d in per_text)):
        out += [d[k] for d in per_text if k < len(d)]
    return out[:n]


def main() -> None:
    plays = _plays()
    for name, field, items in (("lastword.jsonl", "text", lastword_passages(plays, N_LASTWORD)),
                               ("rolling.jsonl", "page", rolling_documents(plays, N_ROLLING))):
        with open(OUT / name, "w", encoding="utf-8") as f:
            for item in items:
                f.write(json.dumps({field: item}, ensure_ascii=False) + "\n")
        print(f"wrote {OUT / name}: {len(items)} examples")


if __name__ == "__main__":
    main()
