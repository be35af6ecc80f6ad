"""Running the pipeline on test checkpoints with small, fast settings."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from harness.runner.calibration import CalibrationSettings
from harness.recipes.quamba.calibration import run_observers
from harness.checkpoints.loading import open_checkpoint
from harness.runner.pipeline import RunConfig, run
from harness.runner.weightbank import WeightBank

FAST_CALIB = CalibrationSettings(num_samples=16, seqlen=64, alpha=0.9995, batch_size=8, seed=42)


def run_modes(model_dir: Path, out_dir: Path, modes: list[str], *, taps: list[str] | None = None,
              layers: list[int] | None = None, seq_len: int = 64, calib: CalibrationSettings = FAST_CALIB,
              cache: bool = True, **kw):
    cfg = RunConfig(model=model_dir, modes=modes, output_file=out_dir / "capture.npz", seq_len=seq_len,
                    calib=calib, cache_dir=(out_dir / "cache") if cache else None, layers=layers or [0],
                    taps=taps or [], **kw)
    return run(cfg, emit=lambda _s: None)


def on_grid(values: np.ndarray, scale: float) -> bool:
    """Every value is code * scale (fp32) for an integer code in [-128, 127]."""
    codes = np.round(values.astype(np.float64) / scale)
    back = (codes * np.float32(scale)).astype(np.float32)
    return bool(np.array_equal(back, values) and codes.min() >= -128 and codes.max() <= 127)


def observed_bank(model_dir: Path, ids_len: int):
    """A weight bank, layer-0 scales observed on 4 seeded windows of 24 tokens (alpha 0.9995), and one
    seeded sample of `ids_len` tokens: (bank, scales per layer, ids)."""
    import torch

    bank = WeightBank(open_checkpoint(model_dir))
    g = torch.Generator().manual_seed(0)
    windows = torch.randint(0, bank.ckpt.dims.vocab_size, (4, 24), generator=g)
    scales, _ = run_observers(bank, windows, 0, 0.9995, 4)
    return bank, scales, torch.randint(0, bank.ckpt.dims.vocab_size, (1, ids_len), generator=g)


# small capture settings for command-line tests: a 16-token sample, 4 calibration windows of 16 tokens
FAST_CLI = ["--seq_len", "16", "--calib_data_num", "4", "--calib_seqlen", "16", "--calib_batch_size", "2"]


def run_cli(main, argv) -> int:
    """A command-line entry (capture_main, compare_main, ...) in-process: its exit code, argparse's too."""
    try:
        return main([str(a) for a in argv])
    except SystemExit as e:
        return e.code


def teacher_forced_steps(model, ids, prompt: int):
    """The prefill over ids[:, :prompt], then one step per remaining token of ids: (the residual stream of every
    step (batch, steps, d_model), the states after each step)."""
    import torch

    _, states = model.prefill(ids[:, :prompt])
    outs, kept = [], []
    for k in range(prompt, ids.shape[1]):
        residual, states = model.step(ids[:, k:k + 1], states)
        outs.append(residual)
        kept.append(states)
    return torch.cat(outs, 1), kept


def rel_per_step(a, b) -> list[float]:
    """Relative L2 of a against b at every step (axis 1)."""
    return [float((a[:, k] - b[:, k]).norm() / b[:, k].norm()) for k in range(a.shape[1])]


def capture_w4_checkpoint(path, recipe: str, tmp_path) -> tuple[dict, dict]:
    """Capture the mode named for a Quamba2 W4 checkpoint's recipe ("W4A8", "W4A16") from it, layers 0 and 1, every
    tap, with no calibration text at hand: (the stats, the mode's calibration record)."""
    import json

    from harness.cli import capture_main

    mode, key = f"q2-{recipe.lower()}", f"quamba2-{recipe.lower()}"
    out = tmp_path / "q.npz"
    rc = run_cli(capture_main, ["--model", path, "--modes", mode, "--output_file", out, "--seq_len", 12,
                                "--layers", 0, 1, "--taps", "all", "--quiet", "--calib_file", tmp_path / "absent.txt"])
    assert rc == 0
    stats = json.loads(out.with_name("q_stats.json").read_text())
    calib = stats["provenance"]["calibration_by_prep"][key]
    assert calib["source"] == "checkpoint" and calib["prep"] == key and "gptq" not in calib
    assert stats["modes"][mode]["status"] == "ok"
    return stats, calib


def input_hessians(block, residuals, dims):
    """GPTQ's Hessians of in_proj (its input: the block's norm.out) and out_proj (had.out) over one forward of
    `block` per residual batch, one add per sequence, written out with the block's hooks."""
    from harness.emulation.gptq import Hessian

    h_in, h_out = Hessian(dims.d_model), Hessian(dims.d_inner)
    for r in residuals:
        taps = {}
        hooks = [block.hooks[k].register_forward_hook(lambda _m, _i, o, k=k: taps.__setitem__(k, o))
                 for k in ("norm_out", "had_out")]
        block(r)
        for h in hooks:
            h.remove()
        for seq in range(r.shape[0]):
            h_in.add(taps["norm_out"][seq])
            h_out.add(taps["had_out"][seq])
    return h_in, h_out


def cache_entry(path) -> dict:
    """The header of the layer cache entry at `path` (runner.layercache): format, version, kind, key, payload, ..."""
    import json

    with np.load(path, allow_pickle=False) as z:
        return json.loads(z["__entry__"].tobytes())


def edit_cache_entry(path, edit) -> None:
    """Rewrite the layer cache entry at `path` with its payload changed by edit(payload) (in place) under a valid
    checksum: an entry that only the recipe's own checks can refuse."""
    import json

    from harness.runner.layercache import _digest

    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files if k != "__entry__"}
    header = cache_entry(path)
    edit(header["payload"])
    body = {k: v for k, v in header.items() if k != "checksum"}
    text = json.dumps({**body, "checksum": _digest(body, arrays)}).encode()
    with open(path, "wb") as f:
        np.savez(f, **arrays, __entry__=np.frombuffer(text, np.uint8))
