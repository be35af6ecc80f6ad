"""Device check of the Quamba-SE emulation (docs/se-modes.md): the fork's quantizer expressions written as its code
writes them (798253405/Quamba-SE f4d350a quamba/qMambaLayer.py), run on a CUDA tensor, against harness.kernels.vquant
on the CPU with the reciprocal-multiply division ("recip") and with exact division ("exact"). Prints, per mode, how
many u values and x_proj codes differ. Needs torch with CUDA; prints why not and exits 0 without one.

    python tools/se_gpu_check.py

Run on an NVIDIA H200 (torch 2.11.0+cu130, 2026-11-28; the expressions and inputs of this file, sent as a
self-contained script): every quantizer's u and codes equal the "recip" emulation bit for bit on all 163 200 values,
and differ from "exact" in 4-47 u values and 4-5789 codes (6-3's x_proj codes are its fine-grid ties); x / s is
x * fl32(1/s), and x / (0-dim CUDA tensor) is exact. tests/kernels/test_vquant.py holds the same expressions on
the CPU (where PyTorch divides exactly) to the "exact" emulation.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

__all__ = ["main", "crafted", "MODES"]


def _roundf_like(x, torch):
    return torch.where(x >= 0, torch.floor(x + 0.5), torch.ceil(x - 0.5))  # qMambaLayer.py:1433-1435


def _fork(mode: str, x, scale: float, os: float, torch):
    """(u, x_proj codes) as the fork computes them on x (a CUDA tensor); scale, os Python floats."""
    r = lambda v: _roundf_like(v, torch)  # noqa: E731
    if mode == "5-0":  # :1437-1443
        q = r(x / scale).clamp(-128, 127)
        return q * scale, q.to(torch.int8)
    if mode == "5-2":  # :1695-1708
        q = r(x / scale)
        u = torch.where(q.abs() > 127, x, torch.clamp(q, -128, 127) * scale)
    elif mode == "5-3":  # :1770-1800
        q = r(x / scale)
        out = q.abs() > 127
        vals = x[out]
        o = (vals.abs().max() / 127.0).clamp(min=scale) if vals.numel() > 0 else scale
        u = torch.where(out, torch.clamp(r(x / o), -128, 127) * o, torch.clamp(q, -128, 127) * scale)
    elif mode == "5-4":  # :1880-1892
        qs = scale / 4.0
        q = r(x / scale)
        u = torch.where(q.abs() < 32, r(x / qs).clamp(-127, 127) * qs, q.clamp(-128, 127) * scale)
    elif mode == "5-6":  # :2025-2048
        qs = scale / 4.0
        mq = 32 * qs
        ax, sx = torch.abs(x), torch.sign(x)
        k = torch.floor(torch.log2(torch.clamp(ax - mq, min=qs) / qs)).clamp(0, 255)
        u = torch.where(ax <= mq, r(x / qs).clamp(-127, 127) * qs, sx * (mq + (2.0 ** k) * qs))
    elif mode == "5-7":  # :2199-2232
        hs, ls = scale / 4.0, scale * 4.0
        hm, mm = 63 * hs, 143 * scale
        ax, sx = torch.abs(x), torch.sign(x)
        high, mid = ax <= hm, (ax > hm) & (ax <= mm)
        x_high = r(x / hs).clamp(-63, 63) * hs
        x_mid = sx * r(ax / scale).clamp(16, 143) * scale
        x_low = sx * (mm + r((ax - mm) / ls).clamp(0, 63) * ls)
        u = torch.where(high, x_high, torch.where(mid, x_mid, x_low))
    elif mode == "6-3":  # :2616-2634
        hs = scale / 2.0
        q = torch.round(x / scale)
        u = torch.where(q.abs() < 64, torch.round(x / hs).clamp(-127, 127) * hs, q.clamp(-128, 127) * scale)
        return u, torch.round(u / scale).clamp(-128, 127).to(torch.int8)
    elif mode == "6-4":  # :2766-2780
        q = torch.round(x / scale)
        out = q.abs() > 127
        u = q.clamp(-128, 127) * scale
        if out.any():
            u = u.clone()
            u[out] = torch.round(x[out] / os).clamp(-128, 127) * os
        return u, torch.round(u / scale).clamp(-128, 127).to(torch.int8)
    else:
        raise ValueError(mode)
    return u, r(u / scale).clamp(-128, 127).to(torch.int8)


def _emulated(mode: str, x, scale: float, os: float, div: str):
    from harness.kernels import vquant as V
    if mode == "5-0":
        v = V.vq_grid(x, scale, "rna", div)
        return v.u, V.xproj_codes(x, scale, "rna", div).codes
    quant = {"5-2": lambda: V.vq_outlier(x, scale, "rna", div),
             "5-3": lambda: V.vq_dual(x, scale, V.dynamic_outlier_scale(x, scale, "rna", div), "rna", div),
             "5-4": lambda: V.vq_fine(x, scale, 4, 32, "rna", div),
             "5-6": lambda: V.vq_quarter_log2(x, scale, div),
             "5-7": lambda: V.vq_three_segment(x, scale, div),
             "6-3": lambda: V.vq_fine(x, scale, 2, 64, "rne", div),
             "6-4": lambda: V.vq_dual(x, scale, os, "rne", div)}[mode]()
    rounding = "rne" if mode.startswith("6") else "rna"
    return quant.u, V.xproj_codes(quant.u, scale, rounding, div).codes


def crafted(n_random: int = 50_000):
    """The check's input: n_random normal values (sigma 30 s), the ties of the s/4 and s grids, each with its fp32
    neighbours on either side. Returns (x fp32, s, os)."""
    import numpy as np
    import torch
    scale = float(np.float32(0.0123456789))
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(n_random, generator=g) * 30 * scale,
                   ((torch.arange(-600, 600, dtype=torch.float64) / 4 + 0.125) * scale).float(),
                   (torch.arange(-1600, 1600, dtype=torch.float64) / 4 * scale).float()])
    x = torch.cat([x, torch.nextafter(x, torch.tensor(np.inf)), torch.nextafter(x, torch.tensor(-np.inf))])
    return x, scale, float(np.float32(3.1 * scale))


MODES = ("5-0", "5-2", "5-3", "5-4", "5-6", "5-7", "6-3", "6-4")


def main() -> int:
    try:
        import torch
    except ImportError as e:
        print(f"no torch here ({e}); nothing checked")
        return 0
    if not torch.cuda.is_available():
        print("torch has no CUDA device here; nothing checked")
        return 0
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    x, scale, os = crafted()
    xc = x.cuda()
    for mode in MODES:
        u_gpu, c_gpu = (t.cpu() for t in _fork(mode, xc, scale, os, torch))
        row = [f"{mode}:"]
        for div in ("recip", "exact"):
            u, c = _emulated(mode, x, scale, os, div)
            row.append(f"{div}: u differs {int((u != u_gpu).sum())}, codes differ {int((c != c_gpu).sum())}")
        print("  ".join(row), f"(of {x.numel()})")
    d_gpu = (xc / scale).cpu()
    print("x / s on CUDA == x * fl32(1/s):", bool(torch.equal(d_gpu, x * (torch.tensor(1.0) / torch.tensor(scale)))),
          "; == exact x / s:", bool(torch.equal(d_gpu, x / torch.tensor(scale))))
    t0 = torch.tensor(scale * 3.3).cuda()
    print("x / (0-dim CUDA tensor) == exact:", bool(torch.equal((xc / t0).cpu(), x / t0.cpu())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
