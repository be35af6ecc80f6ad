"""The emulation's scans against mamba_ssm's Triton kernels on the same inputs, on a GPU (issue 36).

mamba_ssm is imported from its source without its CUDA extension (MAMBA_SKIP_CUDA_BUILD=TRUE builds none): the
package's __init__ imports selective_scan_cuda, so this script registers the package by its path and imports only
its Triton modules (ops/triton/ssd_combined.py, ops/triton/selective_state_update.py; mamba-ssm 2.3.2.post1).
--mamba-ssm DIR: the folder that holds the mamba_ssm package (default: .gpu beside the repository's root).

Compared, each against a float64 oracle of the same recurrence (token by token) and against each other:
  ssd        mamba_chunk_scan_combined (Mamba-2's chunked SSD, dt_softplus, D, final state) vs the harness's
             kernels.ssd.ssd_chunked on CUDA and on the CPU; mamba2-130m's head shape, two chunks
  step2      selective_state_update with heads (Mamba-2's decode step) vs kernels.ssd.ssd_ref over one token
  step1      selective_state_update without heads (Mamba-1's decode step, with z) vs
             kernels.state_update.quant_state_update's fp32 state and output (the state as int8 codes x scale)
Writes benchmarks/results_cuda_kernels.json (or --out): relative L2 and max |difference| of each pair.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _mamba_triton(src: Path):
    """ssd_combined and selective_state_update modules of mamba_ssm at src/mamba_ssm, skipping its __init__."""
    pkg = types.ModuleType("mamba_ssm")
    pkg.__path__ = [str(src / "mamba_ssm")]
    sys.modules["mamba_ssm"] = pkg
    return (importlib.import_module("mamba_ssm.ops.triton.ssd_combined"),
            importlib.import_module("mamba_ssm.ops.triton.selective_state_update"))


def _cmp(a, b) -> dict:
    import torch

    a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
    d = a64 - b64
    return {"rel_l2": float(d.norm() / b64.norm()), "max_abs": float(d.abs().max()),
            "bit_identical": bool(torch.equal(a.detach().float().cpu(), b.detach().float().cpu()))}


def _oracle(x, dt, A, B, C, D, h0=None):
    """float64 recurrence, token by token: h = exp(dt A) h + dt x B^T, y = h C + D x (heads share their group)."""
    import torch

    x, dt, A, B, C, D = (t.double() for t in (x, dt, A, B, C, D))
    b, L, h, p = x.shape
    rep = h // B.shape[2]
    Bh, Ch = B.repeat_interleave(rep, dim=2), C.repeat_interleave(rep, dim=2)
    state = torch.zeros(b, h, p, B.shape[-1], dtype=torch.float64, device=x.device) if h0 is None else h0.double()
    ys = []
    for t in range(L):
        state = state * torch.exp(dt[:, t] * A)[:, :, None, None] + \
            (x[:, t] * dt[:, t, :, None])[..., None] * Bh[:, t, :, None, :]
        ys.append((state * Ch[:, t, :, None, :]).sum(-1) + D[:, None] * x[:, t])
    return torch.stack(ys, 1), state


def _inputs(gen, b: int, L: int, h: int, p: int, g: int, n: int):
    import math

    import torch

    dt_init = torch.exp(torch.rand(h, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    return {"x": torch.randn(b, L, h, p, generator=gen), "dt_raw": 0.5 * torch.randn(b, L, h, generator=gen),
            "dt_bias": dt_init + torch.log(-torch.expm1(-dt_init)),
            "A_log": torch.log(torch.rand(h, generator=gen) * 15 + 1),
            "B": torch.randn(b, L, g, n, generator=gen), "C": torch.randn(b, L, g, n, generator=gen),
            "D": 1 + 0.1 * torch.randn(h, generator=gen)}


def check_ssd(ssd_combined, chunk: int, seqlen: int) -> dict:
    import torch

    from harness.kernels import portable
    from harness.kernels.ssd import ssd_chunked, ssd_dt

    t = _inputs(torch.Generator().manual_seed(0), 1, seqlen, 24, 64, 1, 128)
    A = -portable.exp(t["A_log"].contiguous())
    cpu_y, cpu_s = ssd_chunked(t["x"], ssd_dt(t["dt_raw"], t["dt_bias"]), t["A_log"], t["B"], t["C"], t["D"], chunk)
    g = {k: v.cuda() for k, v in t.items()}
    with torch.device("cuda"):
        dt = ssd_dt(g["dt_raw"], g["dt_bias"])
        emu_y, emu_s = ssd_chunked(g["x"], dt, g["A_log"], g["B"], g["C"], g["D"], chunk)
        ker_y, ker_s = ssd_combined.mamba_chunk_scan_combined(
            g["x"], g["dt_raw"], A.cuda(), g["B"], g["C"], chunk, D=g["D"], dt_bias=g["dt_bias"], dt_softplus=True,
            return_final_states=True)
        ora_y, ora_s = _oracle(g["x"], dt, A.cuda(), g["B"], g["C"], g["D"])
    return {"shape": {"seqlen": seqlen, "chunk": chunk, "nheads": 24, "headdim": 64, "d_state": 128},
            "y": {"kernel_vs_oracle": _cmp(ker_y, ora_y), "emulation_cuda_vs_oracle": _cmp(emu_y, ora_y),
                  "emulation_cuda_vs_kernel": _cmp(emu_y, ker_y), "emulation_cuda_vs_cpu": _cmp(emu_y, cpu_y)},
            "state": {"kernel_vs_oracle": _cmp(ker_s, ora_s), "emulation_cuda_vs_oracle": _cmp(emu_s, ora_s),
                      "emulation_cuda_vs_kernel": _cmp(emu_s, ker_s), "emulation_cuda_vs_cpu": _cmp(emu_s, cpu_s)}}


def check_step2(ssu) -> dict:
    import torch

    from harness.kernels import portable
    from harness.kernels.ssd import ssd_dt, ssd_ref

    h, p, n = 24, 64, 128
    t = _inputs(torch.Generator().manual_seed(1), 2, 1, h, p, 1, n)
    h0 = 0.3 * torch.randn(2, h, p, n, generator=torch.Generator().manual_seed(2))
    A = -portable.exp(t["A_log"].contiguous())
    g = {k: v.cuda() for k, v in t.items()}
    with torch.device("cuda"):
        dt = ssd_dt(g["dt_raw"], g["dt_bias"])
        emu_y, emu_s = ssd_ref(g["x"], dt, g["A_log"], g["B"], g["C"], g["D"], h0=h0.cuda())
        state = h0.cuda().clone()
        ker_y = ssu.selective_state_update(
            state, g["x"][:, 0], g["dt_raw"][:, 0, :, None].expand(-1, -1, p), A.cuda()[:, None, None].expand(h, p, n),
            g["B"][:, 0], g["C"][:, 0], D=g["D"][:, None].expand(h, p), dt_bias=g["dt_bias"][:, None].expand(h, p),
            dt_softplus=True)
        ora_y, ora_s = _oracle(g["x"], dt, A.cuda(), g["B"], g["C"], g["D"], h0=h0.cuda())
    return {"y": {"kernel_vs_oracle": _cmp(ker_y, ora_y[:, 0]), "emulation_cuda_vs_oracle": _cmp(emu_y, ora_y),
                  "emulation_cuda_vs_kernel": _cmp(emu_y[:, 0], ker_y)},
            "state": {"kernel_vs_oracle": _cmp(state, ora_s), "emulation_cuda_vs_oracle": _cmp(emu_s, ora_s),
                      "emulation_cuda_vs_kernel": _cmp(emu_s, state)}}


def check_step1(ssu) -> dict:
    import torch

    from harness.kernels import portable
    from harness.kernels.quant import quantize
    from harness.kernels.state_update import quant_state_update
    from harness.spec import FloatOut, Rounding

    gen = torch.Generator().manual_seed(3)
    b, d, n = 2, 1536, 16
    x, dt_raw, z = torch.randn(b, d, generator=gen), 0.5 * torch.randn(b, d, generator=gen), torch.randn(b, d, generator=gen)
    B, C, D = torch.randn(b, n, generator=gen), torch.randn(b, n, generator=gen), torch.ones(d)
    A_log = torch.log(torch.arange(1, n + 1, dtype=torch.float32)).repeat(d, 1)
    dt_bias = torch.log(torch.expm1(torch.full((d,), 0.01)))
    h = quantize(0.5 * torch.randn(b, d, n, generator=gen), 0.02, Rounding.HALF_EVEN)
    A = -portable.exp(A_log)
    g = [v.cuda() for v in (x, dt_raw, z, B, C, D, A_log, dt_bias, A)]
    x, dt_raw, z, B, C, D, A_log, dt_bias, A = g
    with torch.device("cuda"):
        hq = type(h)(h.codes.cuda(), h.scale)
        emu_y, _, emu_s = quant_state_update(hq, x, dt_raw, A_log, B, C, D=D, z=z, dt_bias=dt_bias,
                                             out=FloatOut(torch.float32))
        state = hq.dequantize().clone()
        ker_y = ssu.selective_state_update(state, x, dt_raw, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)
    return {"y": {"emulation_cuda_vs_kernel": _cmp(emu_y, ker_y)},
            "state": {"emulation_cuda_vs_kernel": _cmp(emu_s, state)}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mamba-ssm", type=Path, default=ROOT / ".gpu")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results_cuda_kernels.json")
    a = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("fidelity_cuda_kernels: needs a CUDA device; torch sees none here", file=sys.stderr)
        return 2
    ssd_combined, ssu = _mamba_triton(a.mamba_ssm)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "mamba_ssm": "2.3.2.post1"}
    for name, fn in (("ssd", lambda: check_ssd(ssd_combined, 256, 512)), ("step2", lambda: check_step2(ssu)),
                     ("step1", lambda: check_step1(ssu))):
        try:
            result[name] = fn()
        except Exception as exc:  # each check reports on its own: one failing leaves the others' numbers
            result[name] = {"error": f"{type(exc).__name__}: {exc}"}
        a.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
