"""What machine and torch build computed a run: the provenance that says which numbers may move elsewhere.

Float GEMMs go through MKL or oneDNN, whose kernels depend on the CPU (docs/determinism.md);
the stats record the CPU's torch capability, its model name, the BLAS and the build's
versions, and any environment variable that changes those code paths.
"""
from __future__ import annotations

import os
import platform
import re

import torch

__all__ = ["cpu_provenance", "CODE_PATH_ENV"]

# Environment variables that change which kernels torch, MKL and oneDNN run.
CODE_PATH_ENV = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "DNNL_MAX_CPU_ISA", "ONEDNN_MAX_CPU_ISA")


def _cpu_model() -> str | None:
    """The CPU's model name from /proc/cpuinfo (Linux), else platform.processor()."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "Hardware"):
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or None


def _build_line(config: str, pattern: str) -> str | None:
    m = re.search(pattern, config)
    return m.group(1).strip() if m else None


def cpu_provenance() -> dict:
    """{'capability', 'machine', 'model', 'blas', 'mkl', 'onednn', 'env'}: strings or None."""
    config = torch.__config__.show()
    return {
        "capability": torch.backends.cpu.get_cpu_capability(), "machine": platform.machine(), "model": _cpu_model(),
        "blas": _build_line(config, r"BLAS_INFO=([^,\n]+)"),
        "mkl": _build_line(config, r"Math Kernel Library Version ([^\n]+)"),
        "onednn": _build_line(config, r"MKL-DNN (v[^\n]+)"),
        "env": {k: os.environ[k] for k in CODE_PATH_ENV if k in os.environ},
    }
