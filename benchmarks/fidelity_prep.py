"""Measure what prep=quamba changes against prep=exact, piece by piece (docs/fidelity.md).

    .venv/bin/python benchmarks/fidelity_prep.py [--model models/mamba-tiny] [--seq-len 512]

Prints, per layer, how many in_proj / out_proj fp16 weights and int8 codes each part of
Quamba's weight preparation changes (fp16 fold, kernel-order rotation, double out_proj
store), then runs modes 0, 2-1 and 3 with prep=quamba, with prep=exact, and with
prep=quamba but one op-order step reverted (monkeypatched; these runs reuse the
prep=quamba scales from a temporary cache, so only the forward changes), and prints
relative L2 distances of the layer-0 mixer output against each other and against
fp32, plus the share of fp32 exp results of torch that are not correctly rounded.
Nothing is written outside a temporary directory.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import harness.emulation.build as build_mod  # noqa: E402
from harness.runner.calibration import CalibrationSettings  # noqa: E402
from harness.checkpoints.loading import open_checkpoint  # noqa: E402
from harness.kernels.hadamard import hadamard_transform, hadamard_transform_fht  # noqa: E402
from harness.kernels.quant import quantize_weight_fp16, round_to_dtype  # noqa: E402
from harness.kernels.scan import ScanOrder  # noqa: E402
from harness.runner.pipeline import RunConfig, run  # noqa: E402
from harness.architectures.mamba1.weights import fht_fp16, float_layer, quamba_fp16_layer  # noqa: E402

f16 = lambda t: round_to_dtype(t, torch.float16)  # noqa: E731


def frac(a: torch.Tensor, b: torch.Tensor) -> str:
    n = int((a != b).sum())
    return f"{n}/{a.numel()} ({100 * n / a.numel():.2f} %)"


def weights_report(model: Path) -> None:
    ckpt = open_checkpoint(model)
    for layer in range(ckpt.dims.n_layer):
        raw = ckpt.raw_layer(layer)
        exact, quamba = float_layer(raw, True, torch.float16), quamba_fp16_layer(raw)
        fold16 = f16(f16(raw["in_proj"]).double() * f16(raw["norm_weight"]).double())
        fold_only = f16(hadamard_transform(fold16))  # fp16 fold, exact rotation rounded once
        rot_only = fht_fp16(f16(raw["in_proj"].double() * raw["norm_weight"].double()))  # fp32 fold, kernel rotation
        q = lambda t: quantize_weight_fp16(t).codes  # noqa: E731
        print(f"layer {layer} in_proj fp16: quamba vs exact {frac(quamba.in_proj, exact.in_proj)}; int8 codes "
              f"{frac(q(quamba.in_proj), q(exact.in_proj))} (fp16 fold alone {frac(q(fold_only), q(exact.in_proj))}, "
              f"kernel rotation alone {frac(q(rot_only), q(exact.in_proj))})")
        w = f16(raw["out_proj"])
        once = f16(hadamard_transform_fht(hadamard_transform_fht(w).t()).t())
        print(f"layer {layer} out_proj fp16: two stores vs one {frac(quamba.out_proj, once)}; quamba vs exact "
              f"{frac(quamba.out_proj, exact.out_proj)}; int8 codes {frac(q(quamba.out_proj), q(exact.out_proj))}, "
              f"scale {quantize_weight_fp16(quamba.out_proj).scale:.6g} vs {quantize_weight_fp16(exact.out_proj).scale:.6g}")
    emb = f16(ckpt.embedding().float())
    print(f"embedding fp16: kernel rotation vs exact {frac(fht_fp16(emb), f16(hadamard_transform(emb)))}")


def capture(model: Path, seq_len: int, modes: list[str], tmp: Path, name: str) -> dict:
    modes_file = tmp / "modes.json"
    modes_file.write_text(json.dumps({"modes": {f"{m}x": {"base": m, "prep": "exact"} for m in ("0", "2-1", "3")}}))
    cfg = RunConfig(model=model, modes=modes, modes_file=modes_file, output_file=tmp / f"{name}.npz",
                    seq_len=seq_len, calib=CalibrationSettings(), cache_dir=tmp / "cache", taps=["all"])
    return run(cfg, emit=lambda _s: None)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b.astype(np.float64)))


def runs_report(model: Path, seq_len: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        full = capture(model, seq_len, ["fp32", "0", "0x", "2-1", "2-1x", "3", "3x"], tmp, "all").by_mode
        ref = full["fp32"]["output"]
        for m in ("0", "2-1", "3"):
            a, b = full[m], full[f"{m}x"]
            first = next((t for t in a if t.startswith("L0.") and not np.array_equal(a[t], b[t])), None)
            print(f"mode {m}: quamba vs exact output rel L2 {rel(a['output'], b['output']):.3g}; W8A8 error "
                  f"(vs fp32) quamba {rel(a['output'], ref):.3g}, exact {rel(b['output'], ref):.3g}; first differing tap {first}")
        a, b = full["0"]["L0.in_proj.out"], full["0x"]["L0.in_proj.out"]
        print(f"mode 0 in_proj.out values differing: {100 * np.mean(a != b):.2f} %")
        # op-order steps one at a time: prep=quamba with that step as prep=exact computes it
        reverts = {
            "scan gate/sum as REFERENCE": ("scan", lambda: _patch_scan()),
            "in_proj RATIO_THEN_WEIGHT": ("epilogue", lambda: _patch_epilogue()),
            "exact online Hadamard": ("had", lambda: _patch_init(build_mod.EmuHadamard, "fht", False)),
        }
        for label, (_, patch) in reverts.items():
            undo = patch()
            try:
                part = capture(model, seq_len, ["0", "2-1", "3"], tmp, "p").by_mode
            finally:
                undo()
            print(f"revert {label}: " + "; ".join(
                f"mode {m} output rel L2 {rel(part[m]['output'], full[m]['output']):.3g}" for m in ("0", "2-1", "3")))


def _patch_init(cls, attr, value):
    orig = cls.__init__

    def init(self, *a, **kw):
        orig(self, *a, **kw)
        setattr(self, attr, value)
    cls.__init__ = init
    return lambda: setattr(cls, "__init__", orig)


def _patch_scan():
    orig = build_mod._scan_order
    build_mod._scan_order = lambda r, c: ScanOrder.REFERENCE if orig(r, c) is ScanOrder.TORCH else orig(r, c)
    return lambda: setattr(build_mod, "_scan_order", orig)


def _patch_epilogue():
    orig = build_mod.EmuLinear.__init__

    def init(self, weight, order, out):
        if order is build_mod.Epilogue.WEIGHT_THEN_RATIO and type(out).__name__ == "FloatOut" and weight.shape[0] > weight.shape[1]:
            order = build_mod.Epilogue.RATIO_THEN_WEIGHT  # in_proj (2 * d_inner x d_model) only
        orig(self, weight, order, out)
    build_mod.EmuLinear.__init__ = init
    return lambda: setattr(build_mod.EmuLinear, "__init__", orig)


def exp_report() -> None:
    x = torch.linspace(-30, 20, 2_000_001, dtype=torch.float32)
    exact = torch.exp(x.double()).float()
    print(f"torch.exp fp32 not correctly rounded: {100 * float((torch.exp(x) != exact).float().mean()):.2f} % "
          f"of {x.numel()} points in [-30, 20]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "mamba-tiny")
    ap.add_argument("--seq-len", type=int, default=512)
    args = ap.parse_args()
    torch.set_num_threads(2)
    weights_report(args.model)
    exp_report()
    runs_report(args.model, args.seq_len)


if __name__ == "__main__":
    main()
