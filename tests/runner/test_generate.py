"""--generate N: greedy ids per mode through its own step, the first divergence and the agreement."""
import json

import numpy as np
import pytest
import torch

from conftest import make_hf_model, write_hf_dir
from harness.checkpoints.tokenizer import load_tokenizer
from harness.checkpoints.loading import open_checkpoint
from harness.cli import capture_main
from harness.modes import BUILTIN_MODES
from harness.runner.forwards import Forward
from harness.runner.generate import divergence, greedy_ids
from harness.runner.weightbank import WeightBank
from harness.store.reader import load_capture
from harness.store.format import stats_path
from helpers import FAST_CLI, run_cli


def test_divergence_is_the_first_differing_step():
    ref = np.array([[5, 3, 7, 7, 1]])
    assert divergence(ref, np.array([[5, 3, 2, 7, 9]])) == {"first_divergence": 2, "agreement": 0.6}
    assert divergence(ref, ref) == {"first_divergence": None, "agreement": 1.0}
    assert divergence(ref, np.array([[0, 3, 7, 7, 1]]))["first_divergence"] == 0


def test_fp32_greedy_is_transformers_greedy_on_a_tiny_vocabulary(tmp_path):
    model = make_hf_model(vocab=32, d_model=16, n_layer=2, d_state=4, seed=3)
    bank = WeightBank(open_checkpoint(write_hf_dir(tmp_path / "m", model)))
    prompt = torch.randint(0, 32, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=10, do_sample=False, min_new_tokens=10)[:, 7:]
    got = greedy_ids(Forward(BUILTIN_MODES["fp32"], None, [prompt], [], 1), prompt, 10, bank)
    assert got.dtype == np.int64 and got.shape == (1, 10)
    assert np.array_equal(got, want.numpy())


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    out = tmp_path_factory.mktemp("gen") / "G.npz"
    assert run_cli(capture_main, ["--modes", "fp32", "1", "0", *FAST_CLI, "--generate", 8, "--output_file", out,
                                  "--quiet"]) == 0
    return out, json.loads(stats_path(out).read_text())


def test_generated_ids_are_stored_and_compared_per_mode(generated):
    out, stats = generated
    cap = load_capture(out)
    ref = cap.array("fp32", "generated_ids")
    assert ref.shape == (1, 8) and ref.dtype == np.int64
    tok = load_tokenizer(open_checkpoint(stats["provenance"]["model"]["path"]).path)
    for mode in ("1", "0"):
        gen = stats["modes"][mode]["generate"]
        ids = cap.array(mode, "generated_ids")
        assert gen["ids"] == ids[0].tolist()
        assert {k: gen[k] for k in ("first_divergence", "agreement")} == divergence(ref, ids)
        assert gen["text"] == tok.tok.decode(gen["ids"]) and gen["reference_text"] == tok.tok.decode(ref[0].tolist())
    assert "generated_ids" not in stats["comparison"]["modes"]["0"]   # ids are not compared as numbers


def test_the_report_marks_the_first_differing_token():
    from types import SimpleNamespace
    from harness.report.decoding import generate_section
    stats = {"modes": {"fp32": {"generate": {"ids": [1, 2, 3], "tokens": ["a", " b", " c"]}},
                       "0": {"generate": {"ids": [1, 2, 9], "tokens": ["a", " b", " <x>"], "first_divergence": 2,
                                          "agreement": 2 / 3}}}}
    html = generate_section(SimpleNamespace(stats=stats, reference="fp32"))
    assert "<mark> &lt;x&gt;</mark>" in html and "<mark> c</mark>" in html and ">2</td>" in html


def test_the_report_shows_the_generation(generated):
    from harness.report.build import build_report
    out, stats = generated
    html, _ = build_report(out)
    assert 'id="generate"' in html
    for mode in ("1", "0"):
        first = stats["modes"][mode]["generate"]["first_divergence"]
        assert f'<td class="l">{mode}</td><td class="l">{"none" if first is None else first}</td>' in html


def _nan_head_model(tmp_path, arch: str = "mamba1"):
    """A float model whose final norm holds one NaN weight: every logit of every mode is NaN."""
    if arch == "mamba2":
        import shutil
        from conftest import TOKENIZER
        from mamba2_fixtures import make_mamba2
        path = tmp_path / "nan2"
        model = make_mamba2(path, vocab=4096, layers=2, seed=3)
        with torch.no_grad():
            model.backbone.norm_f.weight[0] = float("nan")
        model.save_pretrained(path)
        shutil.copy(TOKENIZER, path / "tokenizer.json")
        return path
    model = make_hf_model(d_model=16, n_layer=2, d_state=4, seed=5)
    with torch.no_grad():
        model.backbone.norm_f.weight[0] = float("nan")
    return write_hf_dir(tmp_path / "nan", model)


@pytest.mark.parametrize("arch", ["mamba1", "mamba2"])
def test_generation_with_nan_logits_fails_the_mode(tmp_path, arch):
    """NaN is never a pass: ids from NaN logits (argmax 0 everywhere) used to agree 1.0 and exit 0."""
    out = tmp_path / "N.npz"
    rc = run_cli(capture_main, ["--model", _nan_head_model(tmp_path, arch), "--modes", "fp32", "--generate", 4,
                                *FAST_CLI, "--output_file", out, "--quiet"])
    stats = json.loads(stats_path(out).read_text())
    assert rc == 1
    entry = stats["modes"]["fp32"]
    assert entry["status"] == "error" and "non-finite" in entry["error"]
    assert entry["nonfinite"][0] == "generation logits at step 0: 4096 NaN and 0 Inf of 4096 values"
    assert len(entry["nonfinite"]) == 4


def test_decode_logits_with_nan_fail_the_mode(tmp_path):
    """--decode's logits go through the same NaN policy: decode.logits is named among the problems."""
    out = tmp_path / "D.npz"
    rc = run_cli(capture_main, ["--model", _nan_head_model(tmp_path), "--modes", "fp32", "--decode", 2,
                                "--end-to-end", *FAST_CLI, "--output_file", out, "--quiet"])
    entry = json.loads(stats_path(out).read_text())["modes"]["fp32"]
    assert rc == 1 and entry["status"] == "error"
    assert any(p.startswith("decode.logits: ") for p in entry["nonfinite"])


def test_generation_is_summarised_on_stdout_with_progress_per_token(tmp_path, capsys):
    """--generate N without --quiet: a "generating" phase of N tokens per mode on stderr, and a table with each
    mode's first divergence, agreement and text on stdout, as the stats hold them."""
    model = write_hf_dir(tmp_path / "m", make_hf_model(d_model=16, n_layer=2, d_state=4, seed=4))
    out = tmp_path / "G.npz"
    assert run_cli(capture_main, ["--model", model, "--modes", "fp32", "0", *FAST_CLI, "--generate", 6,
                                  "--no_cache", "--output_file", out]) == 0
    captured = capsys.readouterr()
    stats = json.loads(stats_path(out).read_text())
    for mode in ("fp32", "0"):
        assert f"generating (mode {mode}) ... (6 tokens)\n" in captured.err
        assert f"\ngenerating (mode {mode}): done in " in captured.err
    gen = stats["modes"]["0"]["generate"]
    first = "none" if gen["first_divergence"] is None else str(gen["first_divergence"])
    lines = captured.out.splitlines()
    table = lines[lines.index("Generation (6 greedy tokens after the prompt) against fp32:") + 1:]
    row = next(line for line in table if line.startswith("0 "))
    assert row.split()[1:3] == [first, f"{gen['agreement']:.6g}"]
    snippet = gen["text"].replace("\n", "\\n")[:20]
    assert snippet.strip() in row
    ref_row = next(line for line in table if line.startswith("fp32 "))
    assert ref_row.split()[1:3] == ["-", "-"]


def test_generation_counts_each_token_on_a_terminal(tmp_path, capsys, monkeypatch):
    import io
    import sys

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    model = write_hf_dir(tmp_path / "m", make_hf_model(d_model=16, n_layer=2, d_state=4, seed=4))
    assert run_cli(capture_main, ["--model", model, "--modes", "fp32", *FAST_CLI, "--generate", 5,
                                  "--no_cache", "--output_file", tmp_path / "G.npz"]) == 0
    assert "generating (mode fp32)  [########################] 5/5 tokens" in tty.getvalue()


def test_an_absurd_generate_is_refused_naming_the_limit(tmp_path, capsys):
    from harness.runner.decodeplan import MAX_GENERATE
    out = tmp_path / "G.npz"
    rc = run_cli(capture_main, ["--modes", "fp32", *FAST_CLI, "--generate", 1000000000, "--output_file", out])
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists()
    assert f"--generate 1000000000 is more than the {MAX_GENERATE} tokens" in err
    assert f"use --generate 1..{MAX_GENERATE}" in err and "Traceback" not in err
