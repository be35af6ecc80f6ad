"""quamba-harness on a Quamba checkpoint (pretrained=DIR, mamba_model_path=the float model): mode 0 runs from the
checkpoint's codes and scales and scores as mode 0 calibrated from the float model with the export's settings;
a float mode without the float model is refused, naming mamba_model_path."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from helpers import run_cli  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

from harness.cli.export import export_main  # noqa: E402
from harness.lmeval.model import QuambaHarnessLM  # noqa: E402
from harness.runner.config import RunError  # noqa: E402

MODEL = Path(__file__).resolve().parents[2] / "models" / "mamba-tiny"
CALIB = {"calib_data_num": "4", "calib_seqlen": "32", "calib_batch_size": "2"}
PAIRS = [("Thou art more lovely and more", " temperate"), ("To be, or not to", " be")]


def _requests() -> list[Instance]:
    return [Instance("loglikelihood", {}, pair, k) for k, pair in enumerate(PAIRS)]


def test_a_quamba_checkpoint_scores_as_its_calibration(tmp_path):
    ckpt = tmp_path / "quamba-tiny-w8a8"
    assert run_cli(export_main, ["--model", MODEL, "--output_dir", ckpt, "--quiet",
                                 *[x for k, v in CALIB.items() for x in (f"--{k}", v)]]) == 0
    from_ckpt = QuambaHarnessLM(pretrained=str(ckpt), mode="0", mamba_model_path=str(MODEL), no_cache=True)
    from_float = QuambaHarnessLM(pretrained=str(MODEL), mode="0", no_cache=True, **CALIB)
    assert from_ckpt.session.calibs["quamba"].info["source"] == "checkpoint"
    got, want = from_ckpt.loglikelihood(_requests()), from_float.loglikelihood(_requests())
    for (g, g_greedy), (w, w_greedy) in zip(got, want):
        assert math.isclose(g, w, rel_tol=1e-4) and g_greedy == w_greedy
    with pytest.raises(RunError, match="mamba_model_path"):
        QuambaHarnessLM(pretrained=str(ckpt), mode="fp32", no_cache=True)
