"""Calibration windows at their boundaries: a document of exactly k windows, one token short, one over."""
import json

import pytest
import torch

from conftest import SHIPPED
from harness.checkpoints.text import DataError, calibration_windows, read_sample
from harness.checkpoints.tokenizer import load_tokenizer

SEQLEN = 8


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(SHIPPED)


def _doc(n_tokens: int, word: str = "the") -> str:
    return " ".join([word] * n_tokens)  # one token per word with the shipped tokenizer (checked below)


def _write(tmp_path, docs, name="calib.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def test_one_token_per_word(tok):
    assert len(tok.encode_documents([_doc(24)])[0]) == 24
    assert tok.eos_id is not None


@pytest.mark.parametrize("n_tokens, windows", [(3 * SEQLEN, 3), (3 * SEQLEN - 1, 2), (3 * SEQLEN + 1, 3),
                                               (SEQLEN, 1)])
def test_a_document_gives_floor_n_over_seqlen_windows(tok, tmp_path, n_tokens, windows):
    path = _write(tmp_path, [_doc(n_tokens)])
    got = calibration_windows(tok, path, windows, SEQLEN, seed=0)
    ids = tok.encode_documents([_doc(n_tokens)])[0]
    assert got.ids.shape == (windows, SEQLEN)
    assert got.ids.reshape(-1).tolist() == ids[: windows * SEQLEN]   # consecutive, from the first token
    assert tok.eos_id not in got.ids.reshape(-1).tolist()
    with pytest.raises(DataError, match=f"gives {windows} calibration samples of {SEQLEN} tokens"):
        calibration_windows(tok, path, windows + 1, SEQLEN, seed=0)


def test_a_document_shorter_than_one_window_gives_none(tok, tmp_path):
    path = _write(tmp_path, [_doc(SEQLEN - 1), _doc(SEQLEN, "a")])
    got = calibration_windows(tok, path, 1, SEQLEN, seed=0)
    assert got.ids.reshape(-1).tolist() == tok.encode_documents([_doc(SEQLEN, "a")])[0]


def test_windows_never_span_two_documents(tok, tmp_path):
    """Two documents of 1.5 windows each give 2 windows, not 3."""
    path = _write(tmp_path, [_doc(SEQLEN + SEQLEN // 2), _doc(SEQLEN + SEQLEN // 2, "a")])
    assert calibration_windows(tok, path, 2, SEQLEN, seed=0).ids.shape == (2, SEQLEN)
    with pytest.raises(DataError, match="gives 2 calibration samples"):
        calibration_windows(tok, path, 3, SEQLEN, seed=0)


def test_only_the_documents_needed_are_used(tok, tmp_path):
    path = _write(tmp_path, [_doc(2 * SEQLEN, w) for w in ("the", "a", "of", "and")])
    got = calibration_windows(tok, path, 2, SEQLEN, seed=0)
    assert (got.n_documents, got.documents_used) == (4, 1)
    got = calibration_windows(tok, path, 3, SEQLEN, seed=0)
    assert got.documents_used == 2 and got.ids.shape == (3, SEQLEN)


def test_the_seed_orders_the_documents(tok, tmp_path):
    words = ("the", "a", "of", "and", "to", "in")
    path = _write(tmp_path, [_doc(SEQLEN, w) for w in words])
    firsts = {tuple(calibration_windows(tok, path, 6, SEQLEN, seed=s).ids[:, 0].tolist()) for s in range(4)}
    assert len(firsts) > 1                                   # the order depends on the seed
    again = calibration_windows(tok, path, 6, SEQLEN, seed=3).ids
    assert again.tolist() == calibration_windows(tok, path, 6, SEQLEN, seed=3).ids.tolist()
    assert sorted(again[:, 0].tolist()) == sorted(tok.encode_documents([w])[0][0] for w in words)


@pytest.mark.parametrize("num, seqlen", [(0, 8), (4, 0), (-1, 8)])
def test_non_positive_sizes_are_refused(tok, tmp_path, num, seqlen):
    with pytest.raises(DataError, match="must be positive"):
        calibration_windows(tok, _write(tmp_path, [_doc(64)]), num, seqlen, seed=0)


def test_sample_of_exactly_the_available_tokens(tok, tmp_path):
    """read_sample joins documents with the end-of-text id; n tokens available means --seq_len n works, n+1 not."""
    path = _write(tmp_path, [_doc(5), _doc(5, "a")], name="text.jsonl")
    total = 5 + 1 + 5 + 1  # each document is followed by the end-of-text id
    got = read_sample(tok, path, total)
    assert got.ids.shape == (1, total) and got.ids[0, 5].item() == tok.eos_id and got.documents_used == 2
    assert read_sample(tok, path, 5).documents_used == 1
    assert read_sample(tok, path, 6).documents_used == 1
    with pytest.raises(DataError, match=f"gives only {total} tokens"):
        read_sample(tok, path, total + 1)


def test_a_sample_of_one_token_is_the_first_token(tok, tmp_path):
    """--seq_len 1 is a valid sample (the first token); only 0 and below are refused
    (without it `seq_len <= 1` passed: data read_sample mutant 2)."""
    path = _write(tmp_path, [_doc(3, "a")], name="text.jsonl")
    got = read_sample(tok, path, 1)
    assert got.ids.tolist() == [tok.encode_documents(["a"])[0]] and got.ids.dtype == torch.int64
    with pytest.raises(DataError, match="positive number of tokens, got 0"):
        read_sample(tok, path, 0)


def test_windows_record_their_file(tok, tmp_path):
    """The provenance (calib_file_sha256) comes from here: the path and the file's sha256."""
    import hashlib
    path = _write(tmp_path, [_doc(2 * SEQLEN)])
    got = calibration_windows(tok, path, 2, SEQLEN, seed=0)
    assert got.path == path and got.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


def test_token_ids_must_be_below_the_vocabulary_size():
    """An id equal to vocab_size is already outside the embedding (a mutant that read `>=` as `>` survived)."""
    import torch

    from harness.checkpoints.text import DataError, check_token_ids

    check_token_ids(torch.tensor([[0, 9]]), 10, "tok.json")
    check_token_ids(torch.zeros((1, 0), dtype=torch.int64), 10, "tok.json")
    with pytest.raises(DataError, match=r"produced token id 10, but the model's embedding has 10 rows \(valid ids 0\.\.9\)"):
        check_token_ids(torch.tensor([[3, 10]]), 10, "tok.json")
    check_token_ids(torch.zeros((1, 0), dtype=torch.int64), 1, "tok.json")  # nothing to check, even for one row


class _CharTokenizer:
    """One id per character, no end-of-text token (a tokenizer without eos_id)."""
    eos_id = None

    def encode_documents(self, docs):
        return [[ord(c) for c in d] for d in docs]


def test_windows_of_a_tokenizer_without_eos_keep_every_token(tmp_path):
    """Without an end-of-text id nothing is stripped from a document's ids (a mutant that always dropped the last
    id survived: the shipped tokenizer has one); one-token windows are valid (a mutant refused seqlen 1)."""
    from harness.checkpoints.text import calibration_windows
    f = tmp_path / "docs.jsonl"
    f.write_text('{"text": "abcdefgh"}\n')
    w = calibration_windows(_CharTokenizer(), f, 2, 4, 0)
    assert w.ids.tolist() == [[97, 98, 99, 100], [101, 102, 103, 104]] and w.ids.dtype == torch.int64
    assert calibration_windows(_CharTokenizer(), f, 3, 1, 0).ids.tolist() == [[97], [98], [99]]
