import json
import shutil

import pytest
import torch

from harness.checkpoints.loading import LAYER_TENSORS, ModelDirError, open_checkpoint
from harness.checkpoints.tokenizer import load_tokenizer


def test_both_formats_give_the_same_model(hf_dir, ssm_dir):
    a, b = open_checkpoint(hf_dir), open_checkpoint(ssm_dir)
    assert (a.format, b.format) == ("transformers", "mamba_ssm")
    assert a.dims == b.dims and a.dims.d_model == 24 and a.dims.n_layer == 2 and a.dims.dt_rank == 2
    for layer in range(2):
        ra, rb = a.raw_layer(layer), b.raw_layer(layer)
        assert all(torch.equal(ra[k], rb[k]) for k in ra)
    assert torch.equal(a.embedding(), b.embedding())
    assert a.prefix_hashes(1) == b.prefix_hashes(1)


def test_only_needed_layers_are_read(hf_dir):
    ckpt = open_checkpoint(hf_dir)
    ckpt.prefix_hashes(0)
    ckpt.raw_layer(0)
    assert not any(k.startswith("backbone.layers.1.") for k in ckpt.tensors_read)
    assert ckpt.read_summary()["count"] == len(ckpt.tensors_read)


def test_missing_directory_names_path_and_contents(tmp_path):
    with pytest.raises(ModelDirError, match=r"model directory .*nope does not exist; a model directory must contain config.json"):
        open_checkpoint(tmp_path / "nope")


@pytest.mark.parametrize("breakage,message", [
    ("no_config", "config.json is missing"),
    ("bad_json", "is not valid JSON"),
    ("no_weights", "no weight file found"),
    ("unknown_keys", "has neither transformers keys"),
    ("wrong_shape", "implies"),
])
def test_malformed_directories(hf_dir, tmp_path, breakage, message):
    d = tmp_path / "m"
    shutil.copytree(hf_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    if breakage == "no_config":
        (d / "config.json").unlink()
    elif breakage == "bad_json":
        (d / "config.json").write_text("{")
    elif breakage == "no_weights":
        (d / "model.safetensors").unlink()
    elif breakage == "unknown_keys":
        (d / "config.json").write_text(json.dumps({"foo": 1}))
    else:
        cfg["state_size"] = 4
        (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelDirError, match=message):
        open_checkpoint(d)


@pytest.mark.parametrize("edit,message", [
    ({"model_type": "jamba", "architectures": ["JambaForCausalLM"]},
     "model_type 'jamba' is not supported; supported model types: mamba, mamba2, falcon_mamba"),
    ({"model_type": "nope"}, "model_type 'nope' is not supported"),
    ({"architectures": ["JambaForCausalLM"]}, "architectures entry 'JambaForCausalLM' is not supported; supported: "
                                                "MambaForCausalLM, .*FalconMambaForCausalLM"),
])
def test_unimplemented_model_kinds_are_refused(hf_dir, tmp_path, edit, message):
    """A model kind no registered architecture declares is refused by name (listing the supported ones), never
    computed as another family (a Falcon-Mamba is its own architecture: tests/architectures/falcon_mamba)."""
    d = tmp_path / "m"
    shutil.copytree(hf_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    assert (cfg["model_type"], cfg["architectures"]) == ("mamba", ["MambaForCausalLM"])  # accepted as is
    cfg.update(edit)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelDirError, match=message):
        open_checkpoint(d)


def test_missing_tensor_is_named(ssm_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(ssm_dir, d)
    sd = torch.load(d / "pytorch_model.bin", weights_only=True)
    del sd["backbone.layers.1.mixer.A_log"]
    torch.save(sd, d / "pytorch_model.bin")
    with pytest.raises(ModelDirError, match="backbone.layers.1.mixer.A_log' is missing; config.json says the model "
                                           "has 2 blocks"):
        open_checkpoint(d)  # before any work, also for a block deeper than the captured ones


def test_pickled_objects_are_refused(tmp_path, hf_dir):
    d = tmp_path / "m"
    shutil.copytree(hf_dir, d, ignore=shutil.ignore_patterns("model.safetensors"))
    torch.save({"backbone.embeddings.weight": torch.zeros(2, 2), "evil": object()}, d / "pytorch_model.bin")
    with pytest.raises(ModelDirError, match="cannot read weights"):
        open_checkpoint(d)


def test_tokenizer_lookup(hf_dir, tmp_path):
    tok = load_tokenizer(hf_dir)
    assert tok.eos_id is not None and tok.encode_documents(["To be"])[0]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelDirError, match="pass --tokenizer DIR"):
        load_tokenizer(empty)
    assert load_tokenizer(empty, hf_dir).path.name == "tokenizer.json"


def test_layer_tensor_table_covers_the_mixer():
    assert set(LAYER_TENSORS) == {"norm_weight", "in_proj", "conv_weight", "conv_bias", "x_proj", "dt_proj",
                                  "dt_bias", "A_log", "D", "out_proj"}


def test_dropping_the_mapped_pages_keeps_every_tensor_and_its_values(hf_dir):
    """The weight bank drops the checkpoint's resident pages between modes: tensors read before (zero-copy
    views of the map) and after must still hold the file's values."""
    from harness.runtime.memory import release_freed

    ckpt = open_checkpoint(hf_dir)
    before = ckpt.raw_layer(0)
    copies = {k: v.clone() for k, v in before.items() if v is not None}
    ckpt.drop_pages()
    assert all(torch.equal(before[k], v) for k, v in copies.items())
    assert all(torch.equal(ckpt.raw_layer(0)[k], v) for k, v in copies.items())
    assert isinstance(release_freed(), bool)


def _rewrite_header(file, edit) -> None:
    """A safetensors file with its JSON header edited in place (the data bytes kept as they are)."""
    import struct

    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def test_tensors_that_share_bytes_are_refused_naming_both(hf_dir, tmp_path):
    """Two header entries with the same data_offsets loaded without complaint (each read the other's values)."""
    d = tmp_path / "m"
    shutil.copytree(hf_dir, d)
    a, b = "backbone.layers.0.mixer.D", "backbone.layers.1.mixer.D"

    def share(header):
        header[b]["data_offsets"] = list(header[a]["data_offsets"])

    _rewrite_header(d / "model.safetensors", share)
    with pytest.raises(ModelDirError, match=rf"model.safetensors: cannot read weights \(ValueError: tensors "
                                            rf"'{a}' \(data_offsets \[\d+, \d+\]\) and '{b}' \(\[\d+, \d+\]\) overlap"):
        open_checkpoint(d)

    def straddle(header):  # a range that starts inside another one
        begin, end = header[a]["data_offsets"]
        header[b]["data_offsets"] = [begin + 4, end + 4]

    shutil.copy(hf_dir / "model.safetensors", d / "model.safetensors")
    _rewrite_header(d / "model.safetensors", straddle)
    with pytest.raises(ModelDirError, match="overlap; each tensor must have bytes of its own"):
        open_checkpoint(d)
    shutil.copy(hf_dir / "model.safetensors", d / "model.safetensors")
    _rewrite_header(d / "model.safetensors", lambda header: None)  # the rewrite itself keeps a valid file
    assert torch.equal(open_checkpoint(d).tensor(b), open_checkpoint(hf_dir).tensor(b))
