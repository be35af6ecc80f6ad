"""Issue 9: every layer, isolated vs accumulated, end to end, many samples, sensitivity."""
import json
import math

import numpy as np
import pytest
import torch

from conftest import make_hf_model, write_hf_dir
from harness.runner.forwards import Forward, run_mode
from harness.emulation.capture import TapError, resolve_layers
from harness.metrics.logits import cross_entropy, end_to_end_metrics, kl_divergence, top1_agreement
from harness.report.data import load_report_data
from harness.metrics.intervals import mean_ci, paired_difference, t_critical
from harness.recipes.registry import resolve_modes
from harness.runner.pairing import open_models
from helpers import run_modes


def _rel_l2(a, b):
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def shared_embedding_modes(tmp_path_factory):
    """A mode whose embedding is fp32's (fp32 activations, rotated) but whose blocks quantize weights."""
    f = tmp_path_factory.mktemp("modes") / "m.json"
    f.write_text(json.dumps({"modes": {"w16": {"base": "fp32", "weights": "fp16", "title": "fp16 weights"}}}))
    return f


@pytest.fixture(scope="module")
def big_run(hf_dir, tmp_path_factory, shared_embedding_modes):
    """3 samples, every layer, isolated, end to end, sensitivity."""
    d = tmp_path_factory.mktemp("big")
    out = run_modes(hf_dir, d, ["fp32", "1", "2-4", "w16"], layers=["all"], seq_len=32, samples=3, isolated=True,
                    end_to_end=True, sensitivity=True, modes_file=shared_embedding_modes)
    out.path = d / "capture.npz"
    return out


def test_layers_resolve_all_ranges_and_negative():
    assert resolve_layers(["all"], 4) == [0, 1, 2, 3]
    assert resolve_layers(["-1"], 4) == [3]
    assert resolve_layers(["0-1", "-2", 1], 4) == [0, 1, 2]
    for bad in (["4"], ["-5"], ["2-1"], ["0-4"], ["x"]):
        with pytest.raises(TapError, match="valid: 0..3"):
            resolve_layers(bad, 4)


def test_t_interval_by_hand():
    assert t_critical(2) == 4.3027 and abs(t_critical(60) - 2.0003) < 2e-4 and abs(t_critical(120) - 1.9799) < 1e-4
    s = mean_ci([1.0, 2.0, 3.0])  # mean 2, s = 1
    half = 4.3027 / math.sqrt(3)
    assert s["mean"] == 2.0 and s["per_sample"] == [1.0, 2.0, 3.0]
    assert s["ci95"] == pytest.approx([2 - half, 2 + half], abs=1e-12)
    assert mean_ci([5.0])["ci95"] == [5.0, 5.0]
    d = paired_difference([3.0, 5.0], [1.0, 2.0])  # differences 2, 3: mean 2.5, s = 0.7071
    assert d["mean_diff"] == 2.5
    assert d["ci95"] == pytest.approx([2.5 - 12.7062 * 0.5, 2.5 + 12.7062 * 0.5], abs=1e-9)


def test_end_to_end_metrics_by_hand():
    # vocabulary of 3; position 0: ref p = (1/2, 1/4, 1/4), mode p = (1/4, 1/2, 1/4); position 1: both uniform
    ref = np.log(np.array([[[0.5, 0.25, 0.25], [1 / 3, 1 / 3, 1 / 3]]]))
    mode = np.log(np.array([[[0.25, 0.5, 0.25], [1 / 3, 1 / 3, 1 / 3]]]))
    ids = np.array([[0, 1]])
    assert kl_divergence(ref, mode) == pytest.approx((0.5 * math.log(2) + 0.25 * math.log(0.5)) / 2, abs=1e-15)
    assert top1_agreement(ref, mode) == 0.5  # argmax 0 vs 1; argmax of a tie is the first on both sides
    assert cross_entropy(ref, ids) == pytest.approx(math.log(4), abs=1e-15)   # only position 0 has a next token
    m = end_to_end_metrics(mode, mode, ids)
    assert m["kl"] == 0 and m["top1_agreement"] == 1 and m["perplexity"] == pytest.approx(2.0)


def test_fp32_logits_equal_transformers(big_run, hf_model):
    logits = big_run.by_mode["fp32"]["logits"]
    assert logits.dtype == np.float32 and logits.shape == (3, 1, 32, hf_model.config.vocab_size)
    with torch.no_grad():
        ref = hf_model(input_ids=torch.as_tensor(big_run.token_ids)).logits.double().numpy()
    assert _rel_l2(logits[:, 0], ref) <= 1e-5
    assert np.abs(logits[:, 0] - ref).max() <= 1e-5 * np.abs(ref).max() * 10


def test_untied_lm_head_is_used(tmp_path):
    model = make_hf_model(vocab=4096, n_layer=1, seed=3)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight) * 0.05)
    out = run_modes(write_hf_dir(tmp_path / "untied", model), tmp_path, ["fp32"], seq_len=16, end_to_end=True)
    with torch.no_grad():
        ref = model(input_ids=torch.as_tensor(out.token_ids)).logits.double().numpy()
    assert _rel_l2(out.by_mode["fp32"]["logits"], ref) <= 1e-5


def test_end_to_end_stats_recompute_from_the_arrays(big_run):
    e2e, ids = big_run.stats["end_to_end"], big_run.token_ids
    ref = big_run.by_mode["fp32"]["logits"]
    for mode in ("fp32", "1", "2-4", "w16"):
        per = [end_to_end_metrics(ref[k], big_run.by_mode[mode]["logits"][k], ids[k:k + 1]) for k in range(3)]
        for metric in ("kl", "top1_agreement", "cross_entropy"):
            want = mean_ci([p[metric] for p in per])
            assert e2e[mode][metric]["mean"] == pytest.approx(want["mean"], rel=1e-12)
            assert e2e[mode][metric]["ci95"] == pytest.approx(want["ci95"], rel=1e-12)
        # perplexity: exp(mean NLL over all 3 x 31 predicted tokens), the windows' own beside it (issue 21)
        ppl, windows = e2e[mode]["perplexity"], mean_ci([p["perplexity"] for p in per])
        assert ppl["pooled"] == pytest.approx(math.exp(np.mean([p["cross_entropy"] for p in per])), rel=1e-12)
        assert ppl["pooled"] != pytest.approx(windows["mean"], rel=1e-9)
        assert ppl["per_window"]["mean"] == pytest.approx(windows["mean"], rel=1e-12)
        assert ppl["per_window"]["ci95"] == pytest.approx(windows["ci95"], rel=1e-12)
        assert ppl["per_window"]["max"] == max(windows["per_sample"])
        if mode != "fp32":   # paired: window by window against fp32's perplexity of the same window
            ref_ppl = [end_to_end_metrics(ref[k], ref[k], ids[k:k + 1])["perplexity"] for k in range(3)]
            want = paired_difference([p["perplexity"] for p in per], ref_ppl)
            assert e2e[mode]["perplexity_diff"]["mean_diff"] == pytest.approx(want["mean_diff"], rel=1e-12)
            assert e2e[mode]["perplexity_diff"]["ci95"] == pytest.approx(want["ci95"], rel=1e-12)
    assert e2e["fp32"]["kl"]["mean"] == 0 and e2e["fp32"]["top1_agreement"]["mean"] == 1
    assert e2e["2-4"]["kl"]["mean"] > e2e["1"]["kl"]["mean"] > 0


def test_isolated_equals_accumulated_for_the_reference_and_shared_embedding(big_run):
    fp = big_run.by_mode["fp32"]
    for i, out in enumerate(("output", "L1.block.out")):
        assert np.array_equal(fp[f"L{i}.block.isolated"], fp[out])
    w16 = big_run.by_mode["w16"]  # same embedding as fp32: layer 0's input is the reference's
    assert np.array_equal(w16["input"], fp["input"])
    assert np.array_equal(w16["L0.block.isolated"], w16["output"])
    assert not np.array_equal(w16["L1.block.isolated"], w16["L1.block.out"])  # layer 1's input differs
    rows = big_run.stats["comparison"]["modes"]["2-4"]
    assert rows["L1.block.isolated"]["sqnr_db"] > rows["L1.block.out"]["sqnr_db"]  # error accumulates


def test_isolated_replays_the_mode_block_on_the_reference_input(big_run, hf_dir):
    """Mode 1 (not rotated) on fp32's input (rotated, converted to the original basis as the file stores it):
    each stored L{i}.block.isolated equals the mode's block run again here on that input, bit for bit,
    and differs from the accumulated output past layer 0 (the replay is not the forward's output)."""
    from harness.runner.forwards import isolated_out
    from harness.runner.backbone import build_backbone

    (recipe,) = resolve_modes(["1"], None)
    model = build_backbone(recipe, open_models(hf_dir, None).bank, None, 1)
    fp, one = big_run.by_mode["fp32"], big_run.by_mode["1"]
    for i, (inp, out) in enumerate((("input", "output"), ("L1.block.in", "L1.block.out"))):
        for k in range(3):
            want = isolated_out(model.blocks[i], torch.from_numpy(fp[inp][k]), False, False).numpy()
            assert np.array_equal(one[f"L{i}.block.isolated"][k], want), (i, k)
    assert not np.array_equal(one["L1.block.isolated"], one["L1.block.out"])


def test_samples_are_independent_and_keep_the_research_layout(big_run, hf_dir, tmp_path):
    assert big_run.token_ids.shape == (3, 32)
    one = run_modes(hf_dir, tmp_path, ["fp32", "2-4"], layers=["all"], seq_len=32, isolated=True, end_to_end=True)
    assert np.array_equal(one.token_ids, big_run.token_ids[:1])
    for mode in ("fp32", "2-4"):
        for name in ("input", "output", "L1.block.isolated", "logits"):
            assert one.by_mode[mode][name].shape[0] == 1   # no sample axis for one sample
            assert np.array_equal(one.by_mode[mode][name], big_run.by_mode[mode][name][0]), (mode, name)
    # the third sample alone gives the same arrays as inside the run of three
    models = open_models(hf_dir, None)
    (recipe,) = resolve_modes(["1"], None)
    ids = torch.as_tensor(big_run.token_ids)
    points = ["L0.block.in", "L0.block.out", "L1.block.out"]
    alone = run_mode(Forward(recipe, None, [ids[2:3]], points, 1, end_to_end=True), models.bank)
    together = run_mode(Forward(recipe, None, [ids[k:k + 1] for k in range(3)], points, 1, end_to_end=True), models.bank)
    for name in ("input", "output", "L1.block.out"):
        assert np.array_equal(alone.arrays[name], together.arrays[name][2])
    assert np.array_equal(alone.logits[0], together.logits[2])


def test_sample_statistics_and_pairs(big_run):
    s = big_run.stats["samples"]
    assert s["count"] == 3 and s["windows"] == [[0, 32], [32, 64], [64, 96]]
    sq = s["metrics"]["2-4"]["L1.block.out"]["sqnr_db"]
    assert len(sq["per_sample"]) == 3 and sq["ci95"][0] <= sq["mean"] <= sq["ci95"][1]
    assert sq["mean"] == pytest.approx(np.mean(sq["per_sample"]))
    pair = next(p for p in s["pairs"] if (p["a"], p["b"], p["metric"]) == ("1", "2-4", "sqnr_db"))
    a, b = s["metrics"]["1"]["L1.block.out"]["sqnr_db"], sq
    assert pair["tensor"] == "L1.block.out"
    assert pair["mean_diff"] == pytest.approx(a["mean"] - b["mean"]) and pair["mean_diff"] > 0
    assert any(p["metric"] == "cross_entropy" and p["tensor"] == "logits" for p in s["pairs"])


def test_sensitivity_and_the_report_reads_it(big_run):
    sens = big_run.stats["sensitivity"]
    assert set(sens) == {"1", "2-4", "w16"} and set(sens["2-4"]) == {"0", "1"}
    for row in sens["2-4"].values():
        assert row["kl"] > 0 and row["kl_share"] == pytest.approx(row["kl"] / big_run.stats["end_to_end"]["2-4"]["kl"]["mean"])
    d = load_report_data(big_run.path)
    rows = d.sensitivity()["2-4"]
    assert {r["layer"] for r in rows} == {0, 1} and all(r["isolated_sqnr_db"] is not None for r in rows)
    assert all(r["kl_share"] is not None for r in rows)
    assert set(d.end_to_end()) == {"fp32", "1", "2-4", "w16"} and d.samples()["count"] == 3


def test_device_plumbing(hf_dir, tmp_path, capsys):
    from harness.runner.forwards import build_head, to_device
    from harness.runner.backbone import build_backbone
    from harness.cli import capture_main

    models = open_models(hf_dir, None)
    (recipe,) = resolve_modes(["fp32"], None)
    model = to_device(build_backbone(recipe, models.bank, None, 1), "meta")
    head = to_device(build_head(recipe, models.bank), "meta")
    tensors = [v for m in [*model.modules(), *head.modules()] for v in vars(m).values() if isinstance(v, torch.Tensor)]
    assert tensors and all(t.device.type == "meta" for t in tensors)
    assert models.bank.layer(0, "fp32", True).in_proj.device.type == "cpu"  # the bank itself stays put
    assert model.embed(torch.zeros(1, 4, dtype=torch.int64)).device.type == "meta"
    out = run_modes(hf_dir, tmp_path, ["fp32"], seq_len=16, device="cpu")
    assert out.stats["provenance"]["device"] == "cpu"
    if not torch.cuda.is_available():
        rc = capture_main(["--model", str(hf_dir), "--device", "cuda", "--output_file", str(tmp_path / "g.npz")])
        assert rc == 2 and "--device cuda was asked for, but torch sees no CUDA device" in capsys.readouterr().err
        assert not (tmp_path / "g.npz").exists()


def test_streamed_file_equals_the_file_written_from_memory(hf_dir, tmp_path, monkeypatch):
    from harness.store.reader import load_capture
    from harness.store.format import write_pair

    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    kw = dict(layers=["all"], taps=["ssm.u"], seq_len=32, samples=2, isolated=True, end_to_end=True)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    held = run_modes(hf_dir, tmp_path / "a", ["fp32", "1", "2-4"], **kw)
    lean = run_modes(hf_dir, tmp_path / "b", ["fp32", "1", "2-4"], keep_arrays=False, **kw)
    assert lean.by_mode == {}   # nothing stays in memory: the reference's arrays were spilled to disk
    assert not list((tmp_path / "b").glob(".quamba-harness-reference-*"))  # and the spill removed
    streamed = [(tmp_path / d / "capture.npz").read_bytes() for d in ("a", "b")]
    assert streamed[0] == streamed[1]
    cf = load_capture(tmp_path / "a" / "capture.npz")
    arrays = {k: cf.npz[k] for k in ("token_ids", "timestamp", "model", "pretrained_dir", "seq_len")}
    for mode, by_tensor in held.by_mode.items():
        arrays.update({f"mode_{mode}_{t}" if t in ("input", "output", "residual") else f"mode_{mode}__{t}": v
                       for t, v in by_tensor.items()})
    stats = write_pair(tmp_path / "mem.npz", arrays, {"x": 1})  # every key: no dedup unless asked (schema 3)
    assert (tmp_path / "mem.npz").read_bytes() == streamed[0]
    assert held.stats["aliases"] == {} and stats["npz"]["sha256"] == held.stats["npz"]["sha256"]
    assert held.stats["comparison"] == lean.stats["comparison"]


@pytest.mark.parametrize("lm_head", ["Linear", "W8A8B16O16Linear"])
def test_quamba_checkpoint_head_is_emulated_as_quamba_computes(tmp_path, lm_head):
    from quamba_fixture import handmade_state_dict, write_handmade

    from harness.kernels import portable
    from harness.recipes.quamba.checkpoint import open_quamba

    q = write_handmade(tmp_path / "q", lm_head=lm_head)
    sd = handmade_state_dict(lm_head=lm_head)
    out = run_modes(q, tmp_path, ["0"], layers=["-1"], basis="rotated", end_to_end=True, reference="0")
    assert not out.failed
    r = torch.from_numpy(out.by_mode["0"]["L1.block.residual"])          # the model's own (rotated) basis
    y = r * (1.0 / portable.sqrt(portable.sum_last(r * r) / r.shape[-1] + open_quamba(q).dims.norm_eps))
    if lm_head == "Linear":   # fp16 norm output, fp16 lm_head (norm_f folded into it), fp16 logits
        w = sd["lm_head.weight"].to(torch.float32)
        expect = torch.nn.functional.linear(y.to(torch.float16).to(torch.float32), w).to(torch.float16).to(torch.float32)
    else:                     # QRMSNorm at the stored output scale (RNE), exact int8 GEMM, x alpha, fp16
        codes = torch.clamp(torch.round(y / torch.tensor(sd["backbone.norm_f.output_scale"], dtype=torch.float32)),
                            -128, 127).to(torch.float64)
        acc = codes @ sd["lm_head.weight"].t()[:4096].to(torch.float64).t()
        expect = (torch.tensor(sd["lm_head.alpha"], dtype=torch.float32) * acc.to(torch.float32)).to(torch.float16)
        expect = expect.to(torch.float32)
    assert np.array_equal(out.by_mode["0"]["logits"], expect.numpy())


def test_command_line_options_and_the_printed_tables(hf_dir, tmp_path, capsys):
    from harness.cli import capture_main, compare_main

    out = tmp_path / "c.npz"
    rc = capture_main(["--model", str(hf_dir), "--modes", "fp32", "2-4", "--layers", "0-1", "--isolated",
                       "--sensitivity", "--samples", "2", "--seq_len", "16", "--calib_data_num", "4",
                       "--calib_seqlen", "32", "--no_cache", "--output_file", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0
    assert "End to end against fp32" in printed and "Sensitivity of mode 2-4 against fp32" in printed
    stats = json.loads((tmp_path / "c_stats.json").read_text())
    assert stats["provenance"]["layers"] == [0, 1] and stats["samples"]["count"] == 2
    assert set(stats["sensitivity"]["2-4"]) == {"0", "1"} and "end_to_end" in stats  # --sensitivity implies it
    assert compare_main([str(out)]) == 0
    assert "isolated SQNR dB" in capsys.readouterr().out


def test_chunked_metrics_equal_the_whole_array_formula():
    g = torch.Generator().manual_seed(1)
    ref, mode = torch.randn(1, 150, 50, generator=g), torch.randn(1, 150, 50, generator=g)
    ids = torch.randint(0, 50, (1, 150), generator=g)
    lr, lm = torch.log_softmax(ref.double(), -1), torch.log_softmax(mode.double(), -1)
    assert kl_divergence(ref, mode) == pytest.approx(float((lr.exp() * (lr - lm)).sum(-1).mean()), rel=1e-12)
    want = float(-lm[:, :-1].gather(-1, ids[:, 1:, None]).mean())
    assert cross_entropy(mode, ids) == pytest.approx(want, rel=1e-12)
