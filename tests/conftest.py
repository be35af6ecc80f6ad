"""Shared fixtures: small seeded Mamba checkpoints written by the tests, in both on-disk formats."""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Ray 2.60's local ray.init() writes a token to ~/.ray/auth_token, and every later cluster and client that finds it
# turns token auth on: one test's local cluster broke the next's `ray start` cluster ("InvalidAuthToken"), and the
# user's home was written. The suite's clusters run without token auth, and none reads or writes ~/.ray.
os.environ["RAY_AUTH_MODE"] = "disabled"
torch.set_num_threads(2)
# Hermetic: the suite's runs (and the harness processes it starts, which inherit the variable) calibrate into a
# cache of their own, empty at the start as on a new machine; the user's ~/.cache/quamba-harness is never read
# or written. Removed when the session ends (pytest_sessionfinish).
TEST_CACHE = Path(tempfile.mkdtemp(prefix="quamba-harness-tests-"))
os.environ["QUAMBA_HARNESS_CACHE"] = str(TEST_CACHE)


# lm-eval's runs (tests/lmeval): the datasets and Hub caches in the same temporary directory, offline, no bootstrap
# pool; set before lm-eval (and with it `datasets`, which reads its cache directory once, on import) is imported.
os.environ.update(HF_DATASETS_CACHE=str(TEST_CACHE / "datasets"), HF_HOME=str(TEST_CACHE / "hf"),
                  HF_DATASETS_OFFLINE="1", DISABLE_MULTIPROC="1")


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(TEST_CACHE, ignore_errors=True)

ROOT = Path(__file__).resolve().parent.parent
# the fixture modules (models, checkpoints, helpers) that tests in every folder import by name
sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))


@pytest.fixture(autouse=True)
def _no_subprocess_under_mutation(monkeypatch):
    """Under mutmut (`make mutation`) a test that runs the harness in a subprocess is skipped: the child
    would import mutmut's trampolined copy without mutmut's state and fail whatever the mutant."""
    if os.environ.get("MUTANT_UNDER_TEST"):
        import subprocess

        def refuse(*_a, **_k):
            pytest.skip("runs the harness in a subprocess: not part of the mutation run")
        monkeypatch.setattr(subprocess, "run", refuse)
        monkeypatch.setattr(subprocess, "Popen", refuse)


@pytest.fixture(autouse=True)
def _no_lm_eval_env_report(monkeypatch):
    """lm-eval's simple_evaluate adds an environment report to every result (lm_eval/evaluator.py:421,
    add_env_info: torch's collect_env, a dozen subprocesses, about a second of CPU a call); no test reads it and
    the harness keeps none of it, so the in-process calls skip it (the subprocesses and workers still make it)."""
    evaluator = sys.modules.get("lm_eval.evaluator")
    if evaluator is not None:
        monkeypatch.setattr(evaluator, "add_env_info", lambda _storage: None)


SHIPPED = ROOT / "models" / "mamba-tiny"
TOKENIZER = SHIPPED / "tokenizer.json"


def make_hf_model(vocab: int = 4096, d_model: int = 24, n_layer: int = 2, d_state: int = 8, seed: int = 0):
    """A transformers MambaForCausalLM with seeded random weights; norm weights and D are perturbed
    away from 1 so that norm folding and the D term are really exercised."""
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(seed)
    cfg = MambaConfig(vocab_size=vocab, hidden_size=d_model, num_hidden_layers=n_layer, state_size=d_state,
                      expand=2, conv_kernel=4)
    model = MambaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.backbone.layers:
            layer.norm.weight.uniform_(0.5, 1.5)
            layer.mixer.D.uniform_(0.5, 1.5)
            layer.mixer.conv1d.bias.normal_(0.0, 0.1)
    return model


def write_hf_dir(path: Path, model) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    shutil.copy(TOKENIZER, path / "tokenizer.json")
    return path


def write_mamba_ssm_dir(path: Path, model) -> Path:
    """The same weights in mamba_ssm's layout: d_model/n_layer config and pytorch_model.bin."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    sd = {k.replace("backbone.embeddings.", "backbone.embedding."): v.clone() for k, v in model.state_dict().items()}
    torch.save(sd, path / "pytorch_model.bin")
    (path / "config.json").write_text(json.dumps({
        "d_model": cfg.hidden_size, "n_layer": cfg.num_hidden_layers, "vocab_size": cfg.vocab_size,
        "ssm_cfg": {"d_state": cfg.state_size}, "rms_norm": True, "residual_in_fp32": True,
        "fused_add_norm": True, "pad_vocab_size_multiple": 8}))
    shutil.copy(TOKENIZER, path / "tokenizer.json")
    return path


@pytest.fixture
def one_thread():
    """torch on one thread for the test (bit-identical comparisons across processes that each use one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def hf_model():
    return make_hf_model()


@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory, hf_model) -> Path:
    return write_hf_dir(tmp_path_factory.mktemp("hf") / "tiny-hf", hf_model)


@pytest.fixture(scope="session")
def ssm_dir(tmp_path_factory, hf_model) -> Path:
    return write_mamba_ssm_dir(tmp_path_factory.mktemp("ssm") / "tiny-ssm", hf_model)


# Under mutmut (`make mutation`), run the selected tests cheapest file first: with -x a killed
# mutant then stops before the tests that run a whole pipeline.
_RUN_LAST = ("test_calibration.py", "test_capture.py", "test_modes.py", "test_unrotate.py", "test_fp16_points.py")


def _measured_durations() -> dict[str, float]:
    """Seconds per test id as mutmut measured them (mutants/mutmut-stats.json; the run's cwd is mutants/)."""
    try:
        return json.loads(Path("mutmut-stats.json").read_text())["duration_by_test"]
    except (OSError, ValueError, KeyError):
        return {}


def pytest_collection_modifyitems(items):
    """mutmut hands a mutant's tests over in a set's order, which interleaves the files: every switch of
    file sets the module-scoped fixtures up again. Here each file's tests run together, in the file's own
    order, the files by their measured cost (cheapest first) and the pipeline tests last."""
    if not os.environ.get("MUTANT_UNDER_TEST"):
        return
    threads = os.environ.get("HARNESS_MUTATION_THREADS")  # tools/mutation.py: cores per worker
    if threads:
        torch.set_num_threads(int(threads))
    durations = _measured_durations()
    cost: dict[Path, float] = {}
    for item in items:
        cost[item.path] = cost.get(item.path, 0.0) + durations.get(item.nodeid, 0.0)
    items.sort(key=lambda item: (item.path.name in _RUN_LAST, cost[item.path], str(item.path), item.location[1] or 0))
