"""--decode and --generate take the steps' starting state from the capture prefill (docs/decode.md "Cost"):
no number moves.

The capture prefill over the prompt runs each block's ``prefill`` (forward's computation plus the state it
hands over), and the decode steps start from those states instead of running the prefill over the prompt a
second time. Proven here on the same machine in the same test run: every array and every stats value of a
``--decode`` run of every built-in mode equals the run that computes the states with a prefill of its own
(the earlier path, still taken when no states come with the mode: workers in other processes), and the
prompt's prefill runs once per mode.
"""
from __future__ import annotations

import re
import sys

import pytest

from conftest import ROOT
from harness.cli import capture_main
from harness.runner.backbone import build_backbone
from harness.emulation.capture import select_points
from harness.emulation.modules import EmuMambaBlock
from harness.recipes.registry import resolve_modes
from harness.runner import modeloop
from harness.runner.forwards import Forward, run_mode
from harness.runner.sharedops import SharedOps
from harness.spec import QTensor
from helpers import FAST_CLI, observed_bank, run_cli

sys.path.insert(0, str(ROOT / "tools"))
from snapshot import _digest  # noqa: E402  (the digests of every array and stats value of a pair)

N = 4
ARGS = ["--modes", "all", "1", *FAST_CLI, "--decode", N, "--layers", "0", "1", "--taps", "all", "--end-to-end",
        "--quiet"]


pytestmark = pytest.mark.usefixtures("one_thread")


def _bits(x) -> tuple:
    """A state (tensor or QTensor) as its kind, scale, dtype, shape and bytes."""
    t = x.codes if isinstance(x, QTensor) else x
    return type(x).__name__, getattr(x, "scale", None), str(t.dtype), tuple(t.shape), t.numpy().tobytes()


def _without_handover(monkeypatch) -> None:
    """The earlier path: decode_mode gets no states and runs the prefill over the prompt itself."""
    original = modeloop.decode_mode
    monkeypatch.setattr(modeloop, "decode_mode", lambda *a: original(*a[:5], None))


def _prefill_lengths(monkeypatch) -> list[int]:
    """The sequence length of every Mamba-1 block computation over more than one token, in call order."""
    seen: list[int] = []
    original = EmuMambaBlock._forward

    def counted(self, residual):
        if self.layer == 0:
            seen.append(int(residual.shape[1]))
        return original(self, residual)
    monkeypatch.setattr(EmuMambaBlock, "_forward", counted)
    return seen


def test_every_array_and_stat_equals_the_run_with_its_own_prefill(tmp_path, monkeypatch):
    new, old = tmp_path / "new" / "X.npz", tmp_path / "old" / "X.npz"
    new.parent.mkdir(), old.parent.mkdir()
    lengths = _prefill_lengths(monkeypatch)
    assert run_cli(capture_main, [*ARGS, "--output_file", new]) == 0
    handed_over = list(lengths)
    lengths.clear()
    _without_handover(monkeypatch)
    assert run_cli(capture_main, [*ARGS, "--output_file", old]) == 0
    a, b = _digest(new, str(new.parent)), _digest(old, str(old.parent))
    assert a["arrays"] == b["arrays"] and sum(k.count("__decode.") for k in a["arrays"]) >= 9 * 25
    assert set(a["stats"]) == set(b["stats"])
    # the first run calibrates (the suite's cache starts empty), the second reuses it: only the source says so
    differ = [k for k in a["stats"] if a["stats"][k] != b["stats"][k] and k != "npz.sha256"
              and not re.fullmatch(r"provenance\.calibration(_by_prep\.[^.]+)?\.source", k)]
    assert differ == [], differ[:10]
    # per mode (nine) the prompt's prefill once (16 tokens) and the consistency prefill over 16 + 4; the
    # calibration's windows (16 tokens as well) come first where a run calibrates (the cache may hold them)
    assert handed_over[-2 * 9:] == [16, 16 + N] * 9 and set(handed_over[:-2 * 9]) <= {16}
    assert lengths[-3 * 9:] == [16, 16 + N, 16] * 9 and set(lengths[:-3 * 9]) <= {16}


def test_generate_equals_the_run_with_its_own_prefill(tmp_path, monkeypatch):
    """--generate: the capture prefill's final residual and states start the greedy steps; the same ids, arrays
    and stats as with greedy_ids' own prefill, and the prompt's prefill runs once per mode."""
    argv = ["--modes", "all", "1", *FAST_CLI, "--generate", 6, "--quiet"]
    new, old = tmp_path / "new" / "G.npz", tmp_path / "old" / "G.npz"
    new.parent.mkdir(), old.parent.mkdir()
    lengths = _prefill_lengths(monkeypatch)
    assert run_cli(capture_main, [*argv, "--output_file", new]) == 0
    handed_over = list(lengths)
    lengths.clear()
    original = modeloop._generate
    monkeypatch.setattr(modeloop, "_generate", lambda *a: original(*a[:6]))
    assert run_cli(capture_main, [*argv, "--output_file", old]) == 0
    a, b = _digest(new, str(new.parent)), _digest(old, str(old.parent))
    assert a["arrays"] == b["arrays"] and sum(k.endswith("__generated_ids") for k in a["arrays"]) == 9
    differ = [k for k in set(a["stats"]) | set(b["stats"]) if a["stats"].get(k) != b["stats"].get(k)
              and k != "npz.sha256"]
    assert differ == [], differ[:10]
    calib = len(handed_over) - 9
    assert handed_over[calib:] == [16] * 9 and lengths[calib:] == [16, 16] * 9


def test_mamba2_and_quamba2_equal_the_run_with_their_own_prefill(tmp_path, monkeypatch):
    """Mamba-2's float step and Quamba2's W8A8 step (its Q2BlockState), --decode and --generate together."""
    argv = ["--model", ROOT / "models" / "mamba2-tiny", "--modes", "fp32", "1", "q2-w8a8", "--seq_len", 16,
            "--decode", 4, "--generate", 4, "--taps", "all", "--end-to-end", "--calib_data_num", 4,
            "--calib_seqlen", 32, "--no_cache", "--quiet"]
    new, old = tmp_path / "new" / "D.npz", tmp_path / "old" / "D.npz"
    new.parent.mkdir(), old.parent.mkdir()
    assert run_cli(capture_main, [*argv, "--output_file", new]) == 0
    _without_handover(monkeypatch)
    original = modeloop._generate
    monkeypatch.setattr(modeloop, "_generate", lambda *a: original(*a[:6]))
    assert run_cli(capture_main, [*argv, "--output_file", old]) == 0
    a, b = _digest(new, str(new.parent)), _digest(old, str(old.parent))
    assert a["arrays"] == b["arrays"] and sum("q2-w8a8__decode." in k for k in a["arrays"]) >= 10
    differ = [k for k in set(a["stats"]) | set(b["stats"]) if a["stats"].get(k) != b["stats"].get(k)
              and k != "npz.sha256"]
    assert differ == [], differ[:10]


def test_the_capture_run_hands_over_the_prefill_state_bit_for_bit(hf_dir):
    """run_mode(keep_states=True), with ops shared across the modes, against EmuBackbone.prefill alone."""
    bank, scales, ids = observed_bank(hf_dir, 12)
    shared = SharedOps()
    for recipe in resolve_modes(["all", "1"], None):
        sc = scales if recipe.needs_calibration else None
        run = run_mode(Forward(recipe, sc, [ids], select_points([0], ["all"]), 0), bank, shared=shared,
                       keep_states=True)
        _, alone = build_backbone(recipe, bank, sc, 0).prefill(ids)
        assert len(run.states) == len(alone) == 1
        assert _bits(run.states[0].conv) == _bits(alone[0].conv), recipe.name
        assert _bits(run.states[0].ssm) == _bits(alone[0].ssm), recipe.name
    assert shared.summary()["reused_by_op"]["ssm"] >= 2  # some of these states came from a shared scan


def test_states_need_one_sample(hf_dir):
    bank, _, ids = observed_bank(hf_dir, 8)
    recipe = resolve_modes(["fp32"], None)[0]
    with pytest.raises(ValueError, match="one sample"):
        run_mode(Forward(recipe, None, [ids, ids], select_points([0], []), 0), bank, keep_states=True)
