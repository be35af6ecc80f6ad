import json

import numpy as np
import pytest
import torch

from harness.runner.calibration import CalibrationSettings
from harness.recipes.quamba.calibration import run_observers
from harness.recipes.quamba.families import calibrate_key as calibrate
from harness.checkpoints.text import DEFAULT_CALIB_FILE, DataError, calibration_windows, read_documents, tokenize_file
from harness.checkpoints.tokenizer import load_tokenizer
from harness.checkpoints.loading import open_checkpoint
from harness.runner.weightbank import WeightBank
from conftest import SHIPPED
from helpers import FAST_CALIB, run_modes


@pytest.fixture(scope="module")
def setup(hf_dir):
    ckpt = open_checkpoint(hf_dir)
    windows = calibration_windows(load_tokenizer(hf_dir), DEFAULT_CALIB_FILE, 12, 48, 42).ids
    return ckpt, WeightBank(ckpt), windows


def test_cache_hit_gives_bit_identical_arrays(hf_dir, tmp_path):
    first = run_modes(hf_dir, tmp_path, ["0", "2-4"], taps=["ssm.u"])
    second = run_modes(hf_dir, tmp_path, ["0", "2-4"], taps=["ssm.u"])
    (tmp_path / "nocache").mkdir()
    fresh = run_modes(hf_dir, tmp_path / "nocache", ["0", "2-4"], taps=["ssm.u"], cache=False)
    assert first.stats["provenance"]["calibration"]["source"] == "computed"
    assert second.stats["provenance"]["calibration"]["source"] == "reused"
    assert fresh.stats["provenance"]["calibration"]["source"] == "computed"
    for mode in ("0", "2-4"):
        for name, arr in first.by_mode[mode].items():
            assert np.array_equal(arr, second.by_mode[mode][name]) and np.array_equal(arr, fresh.by_mode[mode][name])


def test_corrupted_cache_is_detected_recomputed_and_reported(hf_dir, tmp_path, capsys):
    first = run_modes(hf_dir, tmp_path, ["0"])
    path = first.stats["provenance"]["calibration"]["cache_files"][0]
    with np.load(path) as z:
        members = {k: z[k] for k in z.files}
    header = json.loads(members["__entry__"].tobytes())
    header["payload"]["scales"]["s_u"] *= 2  # a silent edit: the checksum no longer matches
    members["__entry__"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **members)
    again = run_modes(hf_dir, tmp_path, ["0"])
    info = again.stats["provenance"]["calibration"]
    assert info["source"] == "recomputed" and "checksum mismatch" in info["reason"]
    assert "recomputing the calibration" in capsys.readouterr().err
    assert np.array_equal(first.by_mode["0"]["output"], again.by_mode["0"]["output"])
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])  # a truncated entry: unreadable
    third = run_modes(hf_dir, tmp_path, ["0"])
    assert third.stats["provenance"]["calibration"]["source"] == "recomputed"
    assert "unreadable (BadZipFile" in third.stats["provenance"]["calibration"]["reason"]
    assert np.array_equal(first.by_mode["0"]["output"], third.by_mode["0"]["output"])


def test_batched_equals_unbatched(setup):
    ckpt, bank, windows = setup
    one, _ = run_observers(bank, windows, 1, 0.9995, batch_size=1)
    many, _ = run_observers(bank, windows, 1, 0.9995, batch_size=12)
    for a, b in zip(one, many):
        for name, value in a.as_dict().items():
            assert value == pytest.approx(b.as_dict()[name], rel=1e-6, abs=0), name


def test_layer_cache_is_shared_between_depths(setup, tmp_path):
    ckpt, bank, windows = setup
    deep = calibrate(bank, windows, FAST_CALIB, 1, ckpt.prefix_hashes(1), tmp_path)
    shallow = calibrate(bank, windows, FAST_CALIB, 0, ckpt.prefix_hashes(0), tmp_path)
    assert deep.info["source"] == "computed" and shallow.info["source"] == "reused"
    assert shallow.scales[0] == deep.scales[0]


def test_too_many_samples_says_how_many_are_available(setup):
    ckpt, bank, windows = setup
    tok = load_tokenizer(ckpt.path)
    per_doc = [len(ids) // 512 for ids in tok.encode_documents(read_documents(DEFAULT_CALIB_FILE))]
    with pytest.raises(DataError, match=f"gives {sum(per_doc)} calibration samples of 512 tokens"):
        calibration_windows(tok, DEFAULT_CALIB_FILE, sum(per_doc) + 1, 512, 0)


def test_windows_are_cut_from_shuffled_documents():
    tok = load_tokenizer(SHIPPED)
    docs = read_documents(DEFAULT_CALIB_FILE)
    w = calibration_windows(tok, DEFAULT_CALIB_FILE, 3, 64, 7)
    first = docs[torch.randperm(len(docs), generator=torch.Generator().manual_seed(7))[0]]
    ids = tok.encode_documents([first])[0]
    assert torch.equal(w.ids, torch.tensor([ids[0:64], ids[64:128], ids[128:192]]))
    assert w.documents_used == 1


def test_shipped_calibration_text_gives_512_distinct_samples():
    tok = load_tokenizer(SHIPPED)
    assert len(tokenize_file(tok, DEFAULT_CALIB_FILE)) > 300_000
    w = calibration_windows(tok, DEFAULT_CALIB_FILE, 512, 512, 42).ids
    assert len({tuple(row.tolist()) for row in w}) == 512


def test_settings_are_validated_and_the_seed_orders_samples():
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        CalibrationSettings(alpha=1.5)
    tok = load_tokenizer(SHIPPED)
    a, b, c = (calibration_windows(tok, DEFAULT_CALIB_FILE, 3, 8, s).ids for s in (1, 1, 2))
    assert torch.equal(a, b) and not torch.equal(a, c)
