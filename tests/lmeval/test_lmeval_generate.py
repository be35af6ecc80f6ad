"""generate_until of quamba-harness: greedy text as lm-eval's hf model generates it (fp32), stop strings honoured."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402

from harness.lmeval.model import QuambaHarnessLM  # noqa: E402

MODEL = Path(__file__).resolve().parents[2] / "models" / "mamba-tiny"
PROMPTS = ["MACBETH.\nIf it were done when 'tis done, then 'twere well\nIt were done", "PROSPERO.\nOur revels now are"]


def _requests(until: list[str], n: int) -> list[Instance]:
    return [Instance("generate_until", {}, (p, {"until": until, "max_gen_toks": n, "do_sample": False}), k)
            for k, p in enumerate(PROMPTS)]


def test_greedy_text_is_the_hf_models():
    ours = QuambaHarnessLM(pretrained=str(MODEL), mode="fp32", no_cache=True)
    hf = get_model("hf")(pretrained=str(MODEL), dtype="float32", device="cpu")
    want = hf.generate_until(_requests(["<|endoftext|>"], 12))
    got = ours.generate_until(_requests(["<|endoftext|>"], 12))
    assert got == want and all(len(g) > 10 for g in got)


def test_generation_stops_at_the_first_stop_string():
    ours = QuambaHarnessLM(pretrained=str(MODEL), mode="fp32", no_cache=True)
    free = ours.generate_until(_requests([], 24))
    cut = ours.generate_until(_requests(["\n"], 24))
    assert any("\n" in f for f in free)  # the stop string would have occurred
    for f, c in zip(free, cut):
        assert "\n" not in c and f.startswith(c) and (c == f or f[len(c)] == "\n")
