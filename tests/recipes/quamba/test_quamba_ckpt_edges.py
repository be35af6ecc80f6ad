"""Quamba checkpoint reader edges: each unsupported config named with its directory, the config's sizes and
Quamba's defaults, unreadable files as clear errors (no pickled code run), a present conv bias checked, the
provenance the reader reports, and what its prefix hashes cover. Small handmade checkpoints, no model run."""
import json
import math

import pytest
import torch

from quamba_fixture import handmade_config, handmade_state_dict, write_handmade

from harness.checkpoints.loading import ModelDirError
from harness.recipes.quamba.checkpoint import SUPPORTED, is_quamba_dir, open_quamba
from harness.recipes.quamba.checkpoint_checks import config_dims as _dims
from harness.spec import ModelDims

RAN = []  # what the pickled payload below ran, if anything loaded it


def _record(what):
    RAN.append(what)
    return what


class _Payload:
    """Pickles as a call of _record: loading it with weights_only=False runs code from the file."""

    def __reduce__(self):
        return (_record, ("code from the checkpoint ran",))


def _config_dir(path, cfg):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _cfg(**changes):
    cfg = handmade_config()
    if changes.pop("no_ssm_layer", False):
        del cfg["ssm_cfg"]["layer"]
    for key, value in changes.items():
        if key.startswith("ssm_"):
            cfg["ssm_cfg"][key[4:]] = value
        else:
            cfg[key] = value
    return cfg


HYBRID = "a hybrid (per-layer W4/W8 mix, is_hybrid) checkpoint"
MLP_OR_ATTN = "a checkpoint with MLP (d_intermediate) or attention layers"


@pytest.mark.parametrize("cfg, what", [
    (_cfg(is_hybrid=True), HYBRID),
    (_cfg(ssm_layer=["W8A8QMamba", "W4A16QMamba"]), HYBRID),
    (_cfg(no_ssm_layer=True), "a Mamba-2 (Quamba2) checkpoint (ssm_cfg.layer 'W8A8QMamba2')"),  # Quamba's default
    (_cfg(ssm_layer="W4A8QMamba2"), "a Mamba-2 (Quamba2) checkpoint (ssm_cfg.layer 'W4A8QMamba2')"),
    (_cfg(ssm_layer="W4A16QMamba"), "ssm_cfg.layer 'W4A16QMamba' (4-bit weights)"),
    (_cfg(norm_cfg={"norm": "RMSNorm"}), "norm_cfg.norm 'RMSNorm'"),
    (_cfg(embedding_cfg={"layer": "W4O16Embedding"}), "embedding_cfg.layer 'W4O16Embedding'"),
    (_cfg(lm_head_cfg={"layer": "W4A16B16O16Linear"}), "lm_head_cfg.layer 'W4A16B16O16Linear'"),
    (_cfg(d_intermediate=64), MLP_OR_ATTN),
    (_cfg(attn_layer_idx=[1]), MLP_OR_ATTN),
], ids=["is_hybrid", "layer_list", "no_layer", "mamba2", "4bit", "norm", "embedding", "lm_head", "mlp", "attention"])
def test_each_unsupported_config_is_named_with_its_directory(tmp_path, cfg, what):
    """The message names the directory, what is not supported and what is (mutants that dropped the path or
    the reason from _unsupported's call, required both is_hybrid and a layer list, let an MLP or attention
    layer through alone, or read the lm_head kind from another key survived: only the words were checked)."""
    path = _config_dir(tmp_path / "q", cfg)
    with pytest.raises(ModelDirError) as err:
        open_quamba(path)
    assert str(err.value) == f"{path}: {what} is not supported; supported: {SUPPORTED}"


def test_a_config_reads_as_the_sizes_quamba_builds():
    """Every size the config states is read from its own key, vocab_size padded to pad_vocab_size_multiple
    (quamba_mixer_seq.py:371-372), and each missing key takes Quamba's default (qMambaLayer.py:761-788: d_state
    16, d_conv 4, expand 2, dt_rank ceil(d_model / 16); padding to 8; eps 1e-5; no MLP). Mutants that read a
    key under another name, changed a default or the padding arithmetic, or took dt_rank "auto" always survived:
    the fixture states only d_state and uses a vocabulary that is already a multiple of 8."""
    full = {"d_model": 768, "n_layer": 3, "vocab_size": 4081, "pad_vocab_size_multiple": 16, "norm_epsilon": 1e-6,
            "d_intermediate": 0, "attn_layer_idx": [],
            "ssm_cfg": {"layer": "W8A8QMamba", "d_state": 8, "d_conv": 3, "expand": 3, "dt_rank": 40},
            "norm_cfg": {"norm": "QRMSNorm"}, "embedding_cfg": {"layer": "W8O16Embedding"},
            "lm_head_cfg": {"layer": "W8A8B16O16Linear"}}
    dims, kinds = _dims(None, full)
    assert dims == ModelDims(d_model=768, d_inner=2304, d_state=8, d_conv=3, dt_rank=40, n_layer=3, vocab_size=4096,
                             norm_eps=1e-6)
    assert kinds == {"embedding": "W8O16Embedding", "lm_head": "W8A8B16O16Linear"}
    bare = {"d_model": 768, "n_layer": 3, "vocab_size": 4090, "ssm_cfg": {"layer": "W8A8QMamba"}}
    dims, kinds = _dims(None, bare)
    assert dims == ModelDims(d_model=768, d_inner=1536, d_state=16, d_conv=4, dt_rank=48, n_layer=3, vocab_size=4096,
                             norm_eps=1e-5)
    assert math.ceil(768 / 17) != 48 and type(dims.vocab_size) is int
    assert kinds == {"embedding": "Embedding", "lm_head": "Linear"}


def test_unreadable_directories_are_clear_errors(tmp_path):
    """A missing or non-object config.json, a missing field, a missing, truncated or non-dict
    pytorch_model.bin: each message names the file and what is wrong (mutants that raised ModelDirError(None)
    or named NoneType instead of the exception survived)."""
    none = tmp_path / "none"
    none.mkdir()
    listed = _config_dir(tmp_path / "listed", [handmade_config()])
    for path in (none, listed):
        with pytest.raises(ModelDirError) as err:
            open_quamba(path)
        assert str(err.value) == f"{path}: config.json is missing or not a JSON object"
    cfg = handmade_config()
    del cfg["vocab_size"]
    path = _config_dir(tmp_path / "field", cfg)
    with pytest.raises(ModelDirError) as err:
        open_quamba(path)
    assert str(err.value) == f"{path}/config.json: missing or malformed field (KeyError: 'vocab_size')"
    path = _config_dir(tmp_path / "nobin", handmade_config())
    with pytest.raises(ModelDirError) as err:
        open_quamba(path)
    assert str(err.value) == (f"{path}: pytorch_model.bin is missing (a Quamba checkpoint holds config.json and "
                              f"pytorch_model.bin)")
    q = write_handmade(tmp_path / "cut")
    f = q / "pytorch_model.bin"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(ModelDirError) as err:
        open_quamba(q)
    assert str(err.value).startswith(f"{f}: cannot read the state dict (RuntimeError: PytorchStreamReader failed")
    q = write_handmade(tmp_path / "list", sd=[torch.zeros(2)])
    with pytest.raises(ModelDirError) as err:
        open_quamba(q)
    assert str(err.value) == f"{q / 'pytorch_model.bin'}: not a state dict"


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_a_state_dict_that_would_run_code_is_refused(tmp_path, legacy, monkeypatch):
    """pytorch_model.bin is unpickled with weights_only=True in both loads (memory-mapped, and the whole-file
    one legacy files need): a pickled call is refused as unreadable and never runs (mutants with
    weights_only=False ran it and then reported missing keys). Passed explicitly, not torch's default:
    TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD turns the default off, not an explicit weights_only=True."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    q = write_handmade(tmp_path / "q")
    sd = {**handmade_state_dict(), "backbone.embedding.extra": _Payload()}
    torch.save(sd, q / "pytorch_model.bin", _use_new_zipfile_serialization=not legacy)
    RAN.clear()
    with pytest.raises(ModelDirError) as err:
        open_quamba(q)
    assert str(err.value).startswith(f"{q / 'pytorch_model.bin'}: cannot read the state dict (UnpicklingError: ")
    assert RAN == []


@pytest.mark.parametrize("bias, got", [(torch.zeros(47, dtype=torch.int8), "a int8 tensor of shape [47]"),
                                       (torch.zeros(48, dtype=torch.int16), "a int16 tensor of shape [48]")])
def test_a_stored_conv_bias_is_checked_like_every_tensor(tmp_path, bias, got):
    """The conv bias is optional, but where block 0 has one every block's must be int8 [d_inner] (mutants that
    never expected a bias let a bad one through to the emulation)."""
    sd = handmade_state_dict()
    sd["backbone.layers.1.mixer.conv1d.bias"] = bias
    q = write_handmade(tmp_path / "q", sd=sd)
    with pytest.raises(ModelDirError) as err:
        open_quamba(q)
    assert str(err.value) == (f"{q / 'pytorch_model.bin'}: 'backbone.layers.1.mixer.conv1d.bias' is {got}, "
                              f"expected a int8 tensor of shape [48]")


def test_the_reader_reports_what_it_is_and_what_it_read(tmp_path):
    """info, stored_dtype and read_summary go into the stats file's provenance as they are (mutants that
    renamed their keys or values survived: only the list of keys read was checked)."""
    q = write_handmade(tmp_path / "q", embedding="W8O16Embedding", lm_head="W8A8B16O16Linear")
    ckpt = open_quamba(q)
    assert ckpt.info() == {"ssm_layer": "W8A8QMamba", "embedding": "W8O16Embedding", "lm_head": "W8A8B16O16Linear"}
    assert ckpt.stored_dtype() == "int8"
    ckpt.embedding()
    assert ckpt.read_summary() == {
        "count": 2, "bytes": 4096 * 24 + 4096 * 2, "checkpoint_bytes": (q / "pytorch_model.bin").stat().st_size,
        "keys": ["backbone.embedding.scales", "backbone.embedding.weight"]}


def test_prefix_hashes_cover_dims_and_every_byte_and_read_no_deeper(tmp_path):
    """One hash per block 0..depth, reading nothing deeper (a mutant hashed one block more); the config's
    norm epsilon changes every hash (a mutant hashed "null" for the dims); one int8 code in the middle of a
    large weight, which repr() elides, changes that block's hash (a mutant hashed tensors by repr)."""
    sd = handmade_state_dict()
    a = write_handmade(tmp_path / "a", sd=dict(sd))
    ckpt = open_quamba(a)
    one = ckpt.prefix_hashes(0)
    assert len(one) == 1 and not any(k.startswith("backbone.layers.1.") for k in ckpt.tensors_read)
    assert ckpt.prefix_hashes(1)[0] == one[0] and len(ckpt.prefix_hashes(1)) == 2
    eps = write_handmade(tmp_path / "eps", sd=dict(sd), config={**handmade_config(), "norm_epsilon": 1e-6})
    assert open_quamba(eps).prefix_hashes(0) != one
    key = "backbone.layers.1.mixer.in_proj.weight"
    w = sd[key].clone()
    w[12, 40] = w[12, 40] + (1 if w[12, 40] < 127 else -1)
    assert repr(w) == repr(sd[key])  # a change repr does not show
    b = write_handmade(tmp_path / "b", sd={**sd, key: w})
    ha, hb = ckpt.prefix_hashes(1), open_quamba(b).prefix_hashes(1)
    assert ha[0] == hb[0] and ha[1] != hb[1]


def test_a_config_with_ssm_cfg_not_an_object_is_not_quambas(tmp_path):
    """is_quamba_dir reads ssm_cfg.layer only from an object (a mutant called .get on a string and crashed
    the directory sniffing that every --model goes through)."""
    assert not is_quamba_dir(_config_dir(tmp_path / "s", {"d_model": 24, "ssm_cfg": "W8A8QMamba"}))


def test_a_w8o16_embedding_reads_as_its_fp16_rows(tmp_path):
    """W8O16Embedding's output is fp16: the exact product code * scale rounded once to fp16
    (quant_embedding_kernel.cuh:65-78); a mutant that handed on the unrounded fp32 product survived (the modes
    tested round their input to fp16 anyway; the prefix hashes hashed the fp32 bytes)."""
    sd = handmade_state_dict(embedding="W8O16Embedding")
    rows = open_quamba(write_handmade(tmp_path / "q", embedding="W8O16Embedding")).embedding()
    want = sd["backbone.embedding.weight"].to(torch.float32) * sd["backbone.embedding.scales"].to(torch.float32)[:, None]
    assert rows.dtype == torch.float16 and torch.equal(rows, want.to(torch.float16))
    assert not torch.equal(rows.to(torch.float32), want)  # the rounding is visible in these rows


def test_layer_spec_of_mamba_130m_is_quambas_checkpoint_layout():
    """layer_spec for mamba-130m's sizes (d_model 768, d_inner 1536, d_state 16, dt_rank 48) lists the keys,
    in state-dict order, and the dtypes and shapes of Quamba's checkpoint (spec notes §2.6): x_proj's 48 + 2 * 16 = 80
    outputs need no padding (a mutant that sized x_proj as dt_rank + 3 * d_state survived at the fixture's
    sizes, where both pad to 32)."""
    from harness.recipes.quamba.checkpoint import F, T0, T11, layer_spec

    d = ModelDims(d_model=768, d_inner=1536, d_state=16, d_conv=4, dt_rank=48, n_layer=24, vocab_size=50280,
                  norm_eps=1e-5)
    i8, m, s = torch.int8, "backbone.layers.5.mixer.", "backbone.layers.5.mixer.selective_scan."

    def lin(name, shape):
        return {f"{m}{name}.weight": (i8, shape), f"{m}{name}.a": T11, f"{m}{name}.b": T11, f"{m}{name}.alpha": F}
    want = {"backbone.layers.5.norm.weight": (torch.float16, (768,)), "backbone.layers.5.norm.output_scale": F,
            **lin("in_proj", (768, 3072)), m + "conv1d.weight": (i8, (1536, 4)), m + "conv1d.bias": (i8, (1536,)),
            **{f"{m}conv1d.{k}": F for k in ("weight_scale", "bias_scale", "input_scale", "output_scale")},
            **lin("x_proj", (1536, 80)), **lin("dt_proj", (48, 1536)),
            s + "dt_bias": (i8, (1536,)), s + "dt_bias_scale": T0, s + "A_log": (i8, (1536, 16)), s + "A_scale": T0,
            s + "D": (i8, (1536,)), s + "D_scale": T0,
            **{s + k: T0 for k in ("u_scale", "dt_scale", "B_scale", "C_scale", "z_scale", "ssm_state_scale")},
            m + "had.x_H_scale": F, **lin("out_proj", (1536, 768))}
    spec = layer_spec(d, 5)
    assert list(spec.items()) == list(want.items())
    del want[m + "conv1d.bias"]
    assert list(layer_spec(d, 5, conv_bias=False).items()) == list(want.items())
