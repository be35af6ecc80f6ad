"""The shipped default model: small, trained, loadable by transformers and by the harness."""
import json

import torch

from conftest import SHIPPED
from harness.checkpoints.text import DEFAULT_TEXT_FILE, tokenize_file
from harness.checkpoints.tokenizer import load_tokenizer
from harness.checkpoints.loading import open_checkpoint


def test_size_and_files():
    assert (SHIPPED / "model.safetensors").stat().st_size < 8 * 2**20
    for name in ("config.json", "tokenizer.json", "training_report.json"):
        assert (SHIPPED / name).is_file()
    ckpt = open_checkpoint(SHIPPED)
    assert ckpt.format == "transformers" and ckpt.dims.d_model == 192 and ckpt.dims.n_layer == 3


def test_it_has_learned():
    """Held-out loss of transformers' own forward, far below the untrained model's."""
    from transformers import MambaForCausalLM

    model = MambaForCausalLM.from_pretrained(SHIPPED).eval()
    ids = tokenize_file(load_tokenizer(SHIPPED), DEFAULT_TEXT_FILE)[: 4 * 256].view(4, 256)
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    report = json.loads((SHIPPED / "training_report.json").read_text())
    assert loss < 5.0 < report["loss_untrained"] - 3
    assert abs(loss - report["loss_trained"]) < 0.5
