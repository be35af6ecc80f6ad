"""The shipped tiny Bamba hybrid (models/bamba-tiny): small, trained, fp32 equal to transformers on real text, and
every analysis runs on it offline, each hybrid recipe included."""
import json

import numpy as np
import torch

from conftest import ROOT
from harness.checkpoints.loading import open_checkpoint
from harness.checkpoints.text import DEFAULT_TEXT_FILE, tokenize_file
from harness.checkpoints.tokenizer import load_tokenizer
from harness.cli import capture_main
from harness.store.reader import load_capture
from helpers import run_cli

TINY = ROOT / "models" / "bamba-tiny"


def _hf():
    from transformers import BambaForCausalLM

    return BambaForCausalLM.from_pretrained(TINY, attn_implementation="eager").eval()


def test_size_files_and_dims():
    assert (TINY / "model.safetensors").stat().st_size < 9 * 2**20
    for name in ("config.json", "tokenizer.json", "training_report.json"):
        assert (TINY / name).is_file()
    d = open_checkpoint(TINY).dims
    assert d.architecture == "bamba" and d.kinds == ("ssm", "mlp", "attention", "mlp", "ssm", "mlp")
    assert (d.d_model, d.n_layer, d.nheads, d.headdim, d.ngroups, d.chunk_size) == (192, 6, 12, 32, 2, 64)
    assert (d.n_heads, d.n_kv_heads, d.head_dim, d.rope_dim, d.d_ff) == (6, 2, 32, 16, 384)


def test_it_has_learned():
    """Held-out loss of transformers' own forward, far below the untrained model's."""
    ids = tokenize_file(load_tokenizer(TINY), DEFAULT_TEXT_FILE)[: 4 * 256].view(4, 256)
    with torch.no_grad():
        loss = _hf()(input_ids=ids, labels=ids).loss.item()
    report = json.loads((TINY / "training_report.json").read_text())
    assert loss < 6.0 < report["loss_untrained"] - 2
    assert abs(loss - report["loss_trained"]) < 1.0, loss


def test_every_analysis_and_recipe_runs_on_it(tmp_path, capsys):
    """fp32, fp16, q2-w8a8 and the W8A8 linear modes on every block, isolated, end to end, two samples, the report."""
    out = tmp_path / "b.npz"
    code = run_cli(capture_main, ["--model", TINY, "--modes", "fp32", "1", "quant_only", "--layers", "all",
                                  "--isolated", "--end-to-end", "--samples", "2", "--seq_len", "96",
                                  "--output_file", out, "--calib_data_num", "4", "--calib_seqlen", "64",
                                  "--no_cache", "--report"])
    assert code == 0, capsys.readouterr().err
    assert (tmp_path / "b_report.html").stat().st_size > 10_000
    assert "Error by layer kind" in (tmp_path / "b_report.html").read_text()
    cap = load_capture(out)
    assert cap.modes() == ["fp32", "1", "q2-w8a8", "q2-w8a8-a8", "q2-w8a8-a8-kv8", "q2-w8a8-a8-kvfp8"]
    logits = cap.array("fp32", "logits")
    ids = torch.as_tensor(np.array(cap.npz["token_ids"]))
    with torch.no_grad():
        ref = _hf()(input_ids=ids).logits.double().numpy()
    assert np.linalg.norm(logits[:, 0] - ref) / np.linalg.norm(ref) <= 1e-5  # 96 tokens: a chunk boundary inside
    kl = {m: v["kl"]["mean"] for m, v in cap.manifest["end_to_end"].items()}
    assert kl["fp32"] == 0 < kl["1"] < kl["q2-w8a8"] < kl["q2-w8a8-a8"] < 0.5, kl
