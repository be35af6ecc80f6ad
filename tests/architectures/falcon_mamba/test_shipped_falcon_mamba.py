"""The shipped tiny Falcon-Mamba (models/falcon-mamba-tiny): small, trained, fp32 equal to transformers on real
text, and every Mamba-1 recipe that runs on Falcon-Mamba runs once on it, offline, with a finite KL to fp32."""
import json
import math

import torch

from conftest import ROOT
from harness.checkpoints.loading import open_checkpoint
from harness.checkpoints.text import DEFAULT_TEXT_FILE, tokenize_file
from harness.checkpoints.tokenizer import load_tokenizer
from harness.runner.calibration import CalibrationSettings
from helpers import run_modes

TINY = ROOT / "models" / "falcon-mamba-tiny"
QUAMBA1 = ["0", "2-0", "2-1", "2-2", "2-3", "2-4", "3"]
QUAMBA2_W4 = ["q2-w4a8", "q2-w4a16"]            # prep=quamba on Mamba-1 blocks
FORMATS = {"modes": {                           # the format knobs (docs/formats.md), each block format on a width
    "fmt-mx": {"base": "fp32", "weight_format": "mxfp4_e2m1", "act_format": "mxfp8_e4m3"},
    "fmt-nv": {"base": "1", "act_format": "nvfp4", "state_format": "bf16"},
}}
TINY_CALIB = CalibrationSettings(num_samples=4, seqlen=32, alpha=0.9995, batch_size=4, seed=42)


def _hf():
    from transformers import FalconMambaForCausalLM

    return FalconMambaForCausalLM.from_pretrained(TINY).eval()


def test_size_files_and_dims():
    assert (TINY / "model.safetensors").stat().st_size < 8 * 2**20
    for name in ("config.json", "tokenizer.json", "training_report.json"):
        assert (TINY / name).is_file()
    assert (TINY / "tokenizer.json").read_bytes() == (ROOT / "models" / "mamba-tiny" / "tokenizer.json").read_bytes()
    d = open_checkpoint(TINY).dims
    assert d.architecture == "falcon_mamba" and d.mixer_rms_eps == 1e-6
    assert (d.d_model, d.n_layer, d.d_inner, d.d_state, d.dt_rank, d.vocab_size) == (192, 3, 384, 16, 12, 4096)


def test_it_has_learned():
    """Held-out loss of transformers' own forward, far below the untrained model's."""
    ids = tokenize_file(load_tokenizer(TINY), DEFAULT_TEXT_FILE)[: 2 * 256].view(2, 256)
    with torch.no_grad():
        loss = _hf()(input_ids=ids, labels=ids).loss.item()
    report = json.loads((TINY / "training_report.json").read_text())
    assert loss < 6.0 < report["loss_untrained"] - 2
    assert abs(loss - report["loss_trained"]) < 1.0, loss


def test_every_falcon_mamba_recipe_runs_on_it(tmp_path):
    """fp32, fp16, Quamba1's modes, Quamba2's W4 modes and two number-format modes, end to end on one 32-token
    sample: fp32 equals transformers' logits, every other mode a finite, positive KL to it."""
    (tmp_path / "m.json").write_text(json.dumps(FORMATS))
    modes = ["fp32", "1", *QUAMBA1, *QUAMBA2_W4, *FORMATS["modes"]]
    result = run_modes(TINY, tmp_path, modes, layers=[0], seq_len=32, calib=TINY_CALIB, end_to_end=True,
                       modes_file=tmp_path / "m.json")
    assert list(result.by_mode) == modes and not result.failed
    assert result.stats["provenance"]["model"]["architecture"] == "falcon_mamba"
    with torch.no_grad():
        ref = _hf()(input_ids=torch.as_tensor(result.token_ids)).logits
    assert float((torch.as_tensor(result.by_mode["fp32"]["logits"]).reshape(ref.shape) - ref).norm() / ref.norm()) <= 1e-5
    kl = {m: r["kl"]["mean"] if isinstance(r["kl"], dict) else r["kl"] for m, r in result.stats["end_to_end"].items()}
    assert kl["fp32"] == 0 and all(math.isfinite(kl[m]) and 0 < kl[m] < 2.0 for m in modes[1:]), kl
    assert kl["1"] < min(kl[m] for m in QUAMBA1), kl  # fp16 is the closest
