"""Hostile calibration inputs (issue 21 items 15 and 15c): a cache entry nested 50,000 deep is reported and
recomputed (and replaced), for a capture and for export; a text or calibration file holding a lone surrogate
or undecodable bytes is exit 2 naming the file and line; a huge line is never tokenized whole; export onto a
linked or dangling --output_dir is refused before any work."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import ROOT
from helpers import FAST_CALIB, FAST_CLI, cache_entry, run_cli

from harness.checkpoints.tokenizer import load_tokenizer
from harness.checkpoints.loading import open_checkpoint
from harness.checkpoints.text import DataError, _token_stream, read_documents
from harness.cli import capture_main, main
from harness.recipes.quamba.families import calibrate_key as calibrate
from harness.runner.export import ExportConfig, ExportError, export
from harness.runner.weightbank import WeightBank

DEEP = "[" * 50_000 + "]" * 50_000


def _deep_entry(path):
    """A cache entry (runner.layercache's .npz) whose JSON header is nested 50,000 deep."""
    with open(path, "wb") as f:
        np.savez(f, __entry__=np.frombuffer(DEEP.encode(), np.uint8))


def test_a_cache_entry_nested_50000_deep_is_reported_recomputed_and_replaced(hf_dir, tmp_path, capsys):
    """It made every quantized mode fail ("calibration failed: RecursionError") until deleted by hand."""
    ckpt = open_checkpoint(hf_dir)
    bank, windows = WeightBank(ckpt), torch.randint(0, ckpt.dims.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    first = calibrate(bank, windows, FAST_CALIB, 1, ckpt.prefix_hashes(1), tmp_path)
    entry = first.info["cache_files"][0]
    _deep_entry(entry)
    again = calibrate(bank, windows, FAST_CALIB, 1, ckpt.prefix_hashes(1), tmp_path)
    assert again.info["source"] == "recomputed" and "RecursionError" in again.info["reason"]
    assert "recomputing the calibration" in capsys.readouterr().err
    assert again.scales == first.scales
    assert cache_entry(entry)["payload"]["scales"] == first.scales[0].as_dict()  # replaced by a valid entry
    assert calibrate(bank, windows, FAST_CALIB, 1, ckpt.prefix_hashes(1), tmp_path).info["source"] == "reused"


def test_export_recomputes_over_a_deep_cache_entry(hf_dir, tmp_path, capsys):
    cache = tmp_path / "cache"
    cfg = ExportConfig(model=hf_dir, output_dir=tmp_path / "q1", calib=FAST_CALIB, cache_dir=cache)
    export(cfg, emit=lambda _s: None)
    entries = sorted(cache.glob("calib-*.npz"))
    assert len(entries) == 2
    for entry in entries:
        _deep_entry(entry)
    lines = []
    export(ExportConfig(model=hf_dir, output_dir=tmp_path / "q2", calib=FAST_CALIB, cache_dir=cache), emit=lines.append)
    assert "calibration: recomputed" in lines[0] and "RecursionError" in capsys.readouterr().err
    assert (tmp_path / "q1" / "pytorch_model.bin").read_bytes() == (tmp_path / "q2" / "pytorch_model.bin").read_bytes()


@pytest.mark.parametrize("kind", ["link-to-empty-dir", "dangling-link", "parent-is-file"])
def test_export_onto_a_link_is_refused_before_any_work(hf_dir, tmp_path, capsys, monkeypatch, kind):
    """It failed with a traceback after the whole calibration (a link cannot be replaced by the directory)."""
    (tmp_path / "empty").mkdir()
    out = tmp_path / "out"
    if kind == "link-to-empty-dir":
        out.symlink_to(tmp_path / "empty")
    elif kind == "dangling-link":
        out.symlink_to(tmp_path / "nowhere")
    else:
        (tmp_path / "file").write_text("mine")
        out = tmp_path / "file" / "out"
    monkeypatch.setattr("harness.recipes.quamba.export.calibrate", lambda *a: pytest.fail("calibration ran"))
    assert run_cli(main, ["export", "--model", hf_dir, "--output_dir", out, "--no_cache"]) == 2
    err = capsys.readouterr().err
    assert (f"--output_dir {out} is a symbolic link" in err if kind != "parent-is-file"
            else f"{tmp_path / 'file'} is not a directory" in err), err
    assert "Traceback" not in err and sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["empty", "out"] if kind != "parent-is-file" else ["empty", "file"])
    assert not any((tmp_path / "empty").iterdir())
    with pytest.raises(ExportError):
        export(ExportConfig(model=hf_dir, output_dir=out))


def test_a_lone_surrogate_or_bad_bytes_name_the_file_and_line(tmp_path):
    calib = tmp_path / "calib.jsonl"
    calib.write_text('{"text": "fine"}\n{"text": "a \\ud800 b"}\n')
    with pytest.raises(DataError, match=r"calib.jsonl:2: holds a lone surrogate \(U\+D800"):
        read_documents(calib)
    calib.write_text('{"text": "fine"}\n"\\udfff"\n')
    with pytest.raises(DataError, match=r"calib.jsonl:2: holds a lone surrogate \(U\+DFFF"):
        read_documents(calib)
    text = tmp_path / "text.txt"
    text.write_bytes(b"line one\nline two\nthree \xff\n")
    with pytest.raises(DataError, match=r"text.txt is not UTF-8 \(line 3, byte 24: invalid start byte\)"):
        read_documents(text)


@pytest.mark.parametrize("option", ["--calib_file", "--text_file"])
def test_a_lone_surrogate_is_exit_2_not_a_traceback(hf_dir, tmp_path, capsys, option):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n' * 3 + '{"text": "\\ud800"}\n')
    code = run_cli(capture_main, ["--model", hf_dir, "--modes", "0", "--output_file", tmp_path / "o.npz",
                                  "--no_cache", option, bad, *FAST_CLI])
    err = capsys.readouterr().err
    assert code == 2 and "bad.jsonl:4: holds a lone surrogate" in err and "Traceback" not in err, err
    assert not list(tmp_path.glob("o*"))


def test_a_capped_document_gives_the_tokens_of_the_whole_one(hf_dir):
    """The cut is made where a word ends: the windows are those of tokenizing the whole document."""
    from harness.checkpoints.text import capped, chars_for
    tok = load_tokenizer(hf_dir)
    g = torch.Generator().manual_seed(3)
    words = ["the", "fox", "émigré", "4096", "it's", "--", "\t", "  ", "\n", "ünïcödé", "x" * 40]
    doc = " ".join(words[int(i)] for i in torch.randint(0, len(words), (40_000,), generator=g))
    whole = next(_token_stream(tok, [doc]))
    for tokens in (32, 128, 1000):
        short = capped(doc, chars_for(tokens, tok))
        assert len(short) < len(doc)
        cut = next(_token_stream(tok, [short]))
        assert len(cut) > tokens and cut[:tokens] == whole[:tokens]


def test_a_50_mb_line_is_not_tokenized_whole(tmp_path):
    """4 x 32 calibration tokens from a file whose one line holds 20 MB: the peak grew by 2.6 GB (4.7 GB for
    50 MB; 200 MB aborted the tokenizer), now by about four times the file (read, decoded, split: +80 MB)."""
    path = tmp_path / "big.jsonl"
    words = ("the quick brown fox jumps over the lazy dog " * ((20 << 20) // 44 + 1))[: 20 << 20]
    path.write_text(json.dumps({"text": words}) + "\n" + json.dumps({"text": "tiny"}) + "\n")
    code = ("import resource, sys; from pathlib import Path\n"
            "from harness.checkpoints.tokenizer import load_tokenizer\n"
            "from harness.checkpoints.text import calibration_windows\n"
            "tok = load_tokenizer(Path('models/mamba-tiny'))\n"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "w = calibration_windows(tok, Path(sys.argv[1]), 4, 32, 42)\n"
            "print(tuple(w.ids.shape), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    shape, grew_mb = out.stdout.split(")")
    assert shape == "(4, 32" and int(grew_mb) < 200, out.stdout


def test_the_shipped_calibration_windows_do_not_change(hf_dir):
    """Capping never touches an ordinary document: 512 x 512 windows of the shipped text are those of the
    uncapped tokenization (the cache keys hash them)."""
    from harness.checkpoints.text import DEFAULT_CALIB_FILE, calibration_windows, chars_for
    tok = load_tokenizer(hf_dir)
    docs = read_documents(DEFAULT_CALIB_FILE)
    assert max(len(d) for d in docs) <= 2 * chars_for(512 * 512, tok)
    assert calibration_windows(tok, DEFAULT_CALIB_FILE, 8, 64, 42).ids.shape == (8, 64)
