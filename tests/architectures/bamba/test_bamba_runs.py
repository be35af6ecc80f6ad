"""A Bamba hybrid through the whole run (fp32 and mode 1: every layer and tap, isolated, end to end, two samples,
sensitivity, the HTML report with the per-layer error grouped by layer kind), and the recipes it does not take yet
refused with exit 2."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from conftest import ROOT
from harness.cli import capture_main, main
from harness.emulation.capture import ATTENTION_POINTS, MAMBA2_POINTS, MLP_POINTS
from harness.report.data import load_report_data
from helpers import FAST_CLI, run_cli, run_modes

from bamba_fixtures import make_bamba

SEQ = 24  # mamba_chunk_size 8: three chunks per sample


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    d = tmp_path_factory.mktemp("bambarun") / "model"
    hf = make_bamba(d, layers=3, attn=(1,), vocab=4096, seed=3)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(ROOT / "models" / "mamba-tiny" / name, d / name)
    return hf, d


@pytest.fixture(scope="module")
def run(hybrid, tmp_path_factory):
    _, d = hybrid
    out = tmp_path_factory.mktemp("bambaout")
    result = run_modes(d, out, ["all"], layers=["all"], taps=["all"], seq_len=SEQ, samples=2, isolated=True,
                       end_to_end=True, sensitivity=True)
    result.path = out / "capture.npz"
    return result


def test_every_block_captures_its_kind_s_points(run):
    assert list(run.by_mode) == ["fp32", "1", "q2-w8a8", "q2-w8a8-a8-kv8"] and not run.failed  # `all` on a hybrid
    fp = run.by_mode["fp32"]
    kinds = ("ssm", "mlp", "attention", "mlp", "ssm", "mlp")
    tables = {"ssm": MAMBA2_POINTS, "attention": ATTENTION_POINTS, "mlp": MLP_POINTS}
    for layer, kind in enumerate(kinds):
        have = {k.split(".", 1)[1] for k in fp if k.startswith(f"L{layer}.")}
        want = (set(tables[kind]) | {"block.isolated"}) - ({"block.in", "block.out", "block.residual"} if layer == 0
                                                            else set())  # layer 0's I/O keep the research names
        assert have == want, (layer, kind, have ^ want)  # fp32 rotates: the Mamba-2 blocks have had.out
    assert fp["L2.attn.scores"].shape == (2, 1, 4, SEQ, SEQ)
    assert list(run.stats["provenance"]["model"]["dims"]["kinds"]) == list(kinds)


def test_logits_equal_transformers_and_the_report_groups_by_kind(run, hybrid, tmp_path):
    hf, _ = hybrid
    with torch.no_grad():
        ref = hf(input_ids=torch.as_tensor(run.token_ids)).logits.double().numpy()
    logits = run.by_mode["fp32"]["logits"]
    assert np.linalg.norm(logits.reshape(ref.shape) - ref) / np.linalg.norm(ref) <= 1e-5
    e2e = run.stats["end_to_end"]
    assert e2e["fp32"]["kl"]["mean"] == 0 < e2e["1"]["kl"]["mean"] < 1e-3
    data = load_report_data(run.path)
    layers, acc, iso = data.layer_sqnr()
    by_kind = data.kind_sqnr()["1"]
    assert {k: r["blocks"] for k, r in by_kind.items()} == {"ssm": 2, "mlp": 3, "attention": 1}
    assert by_kind["attention"]["isolated_min_db"] == iso["1"][2] and by_kind["attention"]["isolated_min_layer"] == 2
    assert by_kind["mlp"]["isolated_min_db"] == min(iso["1"][i] for i in (1, 3, 5))
    assert by_kind["ssm"]["accumulated_min_db"] == min(acc["1"][i] for i in (0, 4))
    page = tmp_path / "r.html"
    assert main(["report", str(run.path), "--output", str(page)]) == 0
    html = page.read_text()
    assert "Error by layer kind: mode 1" in html and "Error by layer kind: mode q2-w8a8" in html
    assert html.count("(breaks first)") == 3  # one kind per mode


def test_quamba2_w8a8_quantizes_the_mamba2_blocks_and_keeps_attention_and_mlp_in_fp16(hybrid, tmp_path):
    """q2-w8a8 on a hybrid: Quamba2's calibration runs the whole rotated fp16 model, its W8A8 blocks replace the
    Mamba-2 blocks, attention and the MLPs stay fp16; decode steps them all together."""
    result = run_modes(hybrid[1], tmp_path, ["fp32", "1", "q2-w8a8"], layers=["all"], taps=["all"], seq_len=SEQ,
                       end_to_end=True, decode=3)
    assert not result.failed
    kl = {m: r["kl"] for m, r in result.stats["end_to_end"].items()}
    assert kl["fp32"] == 0 < kl["1"] < kl["q2-w8a8"] < 0.1
    tensors = result.stats["modes"]["q2-w8a8"]["tensors"]
    assert tensors["L0.norm.out"]["quantized"] and tensors["L4.norm.out"]["quantized"]  # Mamba-2 blocks: int8
    for name in ("L2.norm.out", "L2.attn.q", "L2.attn.scores", "L3.mlp.hidden", "L1.mlp.down"):
        assert not tensors[name]["quantized"], name
        values = result.by_mode["q2-w8a8"][name]
        assert np.array_equal(values.astype(np.float16).astype(np.float32), values), name  # fp16 values
    assert result.stats["modes"]["q2-w8a8"]["decode"]["consistency"]


@pytest.mark.parametrize("mode,says", [("0", "Mamba-1"), ("smq-ssm", "Mamba-1 blocks only"),
                                       ("mambaquant-w8a8", "Mamba-1")])
def test_a_recipe_of_mamba_blocks_only_is_exit_2_on_a_hybrid(hybrid, tmp_path, capsys, mode, says):
    """Quamba1, SmQ-SSM and MambaQuant are Mamba-1 recipes: refused by name on a hybrid, the message naming the modes
    that run there (q2-w4a8, q2-w4a16 and naive among them)."""
    _, d = hybrid
    code = run_cli(capture_main, ["--model", d, "--modes", mode, "--output_file", tmp_path / "c.npz", *FAST_CLI])
    err = capsys.readouterr().err
    assert code == 2 and "does not run on a bamba model" in err and says in err and "Traceback" not in err, err
    assert "q2-w4a8, q2-w4a16" in err and "naive-static" in err


def test_decode_and_generate_step_the_kv_cache_and_the_ssm_states_together(hybrid, tmp_path):
    """--decode over every block: the steps equal the same mode's prefill at the same positions (the consistency
    the decode run reports), the Mamba-2 blocks record their states, the attention and MLP blocks none; --generate's
    greedy ids are transformers' greedy generate."""
    hf, d = hybrid
    result = run_modes(d, tmp_path, ["fp32", "1"], layers=["all"], taps=["all"], seq_len=12, decode=4,
                       generate=3, end_to_end=True)
    assert not result.failed
    fp = result.by_mode["fp32"]
    assert fp["decode.L0.state.ssm"].shape[:2] == (1, 4) and "decode.L2.state.ssm" not in fp
    assert fp["decode.L2.attn.k"].shape == (1, 4, 2, 8) and "decode.L2.attn.scores" not in fp  # one token a step
    cons = result.stats["modes"]["fp32"]["decode"]["consistency"]
    worst = max(v["max_abs"] for v in cons.values() if isinstance(v, dict) and "max_abs" in v)
    assert worst < 1e-4, cons
    with torch.no_grad():
        want = hf.generate(torch.as_tensor(result.token_ids)[:, :12], max_new_tokens=3, do_sample=False)[:, 12:]
    assert np.array_equal(fp["generated_ids"], want.numpy())


def test_the_w8a8_linear_recipe_and_the_kv_cache_knob(hybrid, tmp_path):
    """quant_only on a hybrid: q2-w8a8 (attention and MLP fp16), and the W8A8 linear recipe of attention and the MLPs
    (static per-tensor int8 inputs, per-channel int8 weights) with the KV cache in fp16, int8 or fp8 E4M3; each step
    of quantization costs KL, the int8 KV cache holds the calibrated grid."""
    result = run_modes(hybrid[1], tmp_path, ["fp32", "quant_only"], layers=["all"], taps=["all"], seq_len=SEQ,
                       end_to_end=True)
    assert list(result.by_mode) == ["fp32", "q2-w8a8", "q2-w8a8-a8", "q2-w8a8-a8-kv8", "q2-w8a8-a8-kvfp8"]
    assert not result.failed
    kl = {m: r["kl"] for m, r in result.stats["end_to_end"].items()}
    assert 0 < kl["q2-w8a8"] < kl["q2-w8a8-a8"] < min(kl["q2-w8a8-a8-kv8"], kl["q2-w8a8-a8-kvfp8"]) < 0.1
    layers = result.stats["provenance"]["calibration_by_prep"]["quamba2"]["layers"]
    assert set(layers[2]) == {"s_in", "s_mid", "s_k", "s_v"} and set(layers[3]) >= {"s_in", "s_mid"}
    for mode in ("q2-w8a8-a8", "q2-w8a8-a8-kv8"):
        tensors = result.stats["modes"][mode]["tensors"]
        for name, key in (("L2.norm.out", "s_in"), ("L2.attn.out", "s_mid"), ("L3.mlp.hidden", "s_mid"),
                          ("L3.norm.out", "s_in")):
            assert tensors[name]["quantized"] and tensors[name]["scale"] == layers[int(name[1])][key], (mode, name)
    k8 = result.by_mode["q2-w8a8-a8-kv8"]["L2.attn.k"].astype(np.float64) / layers[2]["s_k"]
    assert np.abs(k8 - np.round(k8)).max() < 1e-3 and np.abs(k8).max() <= 128
    k16 = result.by_mode["q2-w8a8-a8"]["L2.attn.k"].astype(np.float64) / layers[2]["s_k"]
    assert np.abs(k16 - np.round(k16)).max() > 0.1  # the fp16 cache is not on that grid


def test_local_workers_give_the_same_arrays(hybrid, tmp_path):
    """--workers 2 on a hybrid (a float mode and the W8A8 linear one with the int8 KV cache): every array equals the
    single-process run's, bit for bit."""
    runs = []
    for workers in (1, 2):
        (tmp_path / str(workers)).mkdir()
        runs.append(run_modes(hybrid[1], tmp_path / str(workers), ["fp32", "q2-w8a8-a8-kv8"], layers=["all"],
                              taps=["all"], seq_len=16, end_to_end=True, workers=workers))
    one, two = runs
    assert not one.failed and not two.failed and list(one.by_mode) == list(two.by_mode)
    for mode, arrays in one.by_mode.items():
        assert set(arrays) == set(two.by_mode[mode])
        assert all(np.array_equal(a, two.by_mode[mode][k]) for k, a in arrays.items()), mode


def test_the_hybrid_calibration_is_cached_per_block(hybrid, tmp_path):
    """Quamba2's calibration of a hybrid (Mamba-2 blocks' tables, attention and MLP blocks' linear scales) goes into
    the layer cache; a second run reuses every entry and computes the same arrays."""
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    one = run_modes(hybrid[1], first, ["q2-w8a8-a8-kv8"], layers=["all"], taps=["all"], seq_len=16)
    shutil.copytree(first / "cache", second / "cache")
    two = run_modes(hybrid[1], second, ["q2-w8a8-a8-kv8"], layers=["all"], taps=["all"], seq_len=16)
    calib = [r.stats["provenance"]["calibration_by_prep"]["quamba2"] for r in (one, two)]
    assert calib[0]["source"] == "computed" and calib[1]["source"] == "reused"
    assert calib[0]["layers"] == calib[1]["layers"] and set(calib[1]["layers"][2]) == {"s_in", "s_mid", "s_k", "s_v"}
    a, b = one.by_mode["q2-w8a8-a8-kv8"], two.by_mode["q2-w8a8-a8-kv8"]
    assert set(a) == set(b) and all(np.array_equal(v, b[k]) for k, v in a.items())
