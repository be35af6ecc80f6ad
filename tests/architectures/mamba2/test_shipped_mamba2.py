"""The shipped tiny Mamba-2 (models/mamba2-tiny): small, trained, and every analysis runs on it offline."""
import json

import numpy as np
import torch

from conftest import ROOT
from harness.checkpoints.tokenizer import load_tokenizer
from harness.checkpoints.loading import open_checkpoint
from harness.checkpoints.text import DEFAULT_TEXT_FILE, tokenize_file
from harness.cli import capture_main
from harness.store.reader import load_capture
from helpers import run_cli

TINY2 = ROOT / "models" / "mamba2-tiny"


def test_size_files_and_dims():
    assert (TINY2 / "model.safetensors").stat().st_size < 8 * 2**20
    for name in ("config.json", "tokenizer.json", "training_report.json"):
        assert (TINY2 / name).is_file()
    ckpt = open_checkpoint(TINY2)
    d = ckpt.dims
    assert ckpt.format == "transformers" and d.architecture == "mamba2"
    assert (d.d_model, d.n_layer, d.ngroups, d.nheads, d.headdim, d.chunk_size) == (192, 3, 2, 12, 32, 64)


def test_it_has_learned():
    """Held-out loss of transformers' own forward, far below the untrained model's."""
    from transformers import Mamba2ForCausalLM

    model = Mamba2ForCausalLM.from_pretrained(TINY2).eval()
    ids = tokenize_file(load_tokenizer(TINY2), DEFAULT_TEXT_FILE)[: 4 * 256].view(4, 256)
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    report = json.loads((TINY2 / "training_report.json").read_text())
    assert loss < 6.0 < report["loss_untrained"] - 2
    assert abs(loss - report["loss_trained"]) < 1.0, loss  # another text than the 64 held-out windows


def test_every_analysis_runs_on_it(tmp_path, capsys):
    """The main job's options on Mamba-2: --layers, --isolated, --end-to-end, --samples, --report."""
    out = tmp_path / "m2.npz"
    code = run_cli(capture_main, ["--model", TINY2, "--modes", "all", "--layers", "0", "-1", "--isolated",
                                  "--end-to-end", "--samples", "2", "--seq_len", "96", "--output_file", out,
                                  "--calib_data_num", "4", "--calib_seqlen", "64", "--no_cache",
                                  "--report"])
    assert code == 0, capsys.readouterr().err
    assert (tmp_path / "m2_report.html").stat().st_size > 10_000
    cap = load_capture(out)
    stats = cap.manifest
    assert stats["provenance"]["model"]["architecture"] == "mamba2" and cap.modes() == ["fp32", "1", "q2-w8a8", "q2-w4a8",
                                                                                          "q2-w4a16"]
    assert cap.array("fp32", "logits").shape == (2, 1, 96, 4096)  # 96 tokens: one full chunk and a partial one
    assert np.array_equal(cap.array("fp32", "L2.block.isolated"), cap.array("fp32", "L2.block.out"))
    assert "L1.block.out" not in cap.tensors("fp32")  # --layers 0 -1: layers 0 and 2 only
    e2e = stats["end_to_end"]
    assert e2e["fp32"]["kl"]["mean"] == 0 and 0 < e2e["1"]["kl"]["mean"] < 1e-2


def test_resume_adds_a_mode_and_keeps_the_file_s_modes(tmp_path, capsys):
    out = tmp_path / "r.npz"
    base = ["--model", TINY2, "--seq_len", "64", "--taps", "ssd.y", "gnorm.out", "--output_file", out]
    assert run_cli(capture_main, [*base, "--modes", "fp32"]) == 0, capsys.readouterr().err
    before = load_capture(out).array("fp32", "L0.ssd.y").copy()
    assert run_cli(capture_main, [*base, "--modes", "fp32", "1", "--resume"]) == 0, capsys.readouterr().err
    cap = load_capture(out)
    assert cap.modes() == ["fp32", "1"] and np.array_equal(cap.array("fp32", "L0.ssd.y"), before)
    assert cap.array("1", "L0.gnorm.out").shape == (1, 64, 384)
