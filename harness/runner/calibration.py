"""What every recipe's calibration shares: its settings, its result, where its cache lives, and the per-layer cache
keys that chain a layer's inputs (the recipe families calibrate: harness.recipes.*; the cache's entries:
runner.layercache)."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..spec import LayerScales

__all__ = ["CalibrationSettings", "CalibrationResult", "default_cache_dir", "layer_keys", "CALIB_VERSION"]

# Bump when anything that changes computed scales changes (recipe, observers, rounding).
# 2: the key holds the prep; caches of version 1 (one calibration model, before prep) are never reused.
CALIB_VERSION = 2

def default_cache_dir() -> Path:
    env = os.environ.get("QUAMBA_HARNESS_CACHE")
    if env:
        return Path(env)
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "quamba-harness"


@dataclass(frozen=True)
class CalibrationSettings:
    num_samples: int = 512
    seqlen: int = 512
    alpha: float = 0.9995
    batch_size: int = 8
    seed: int = 42

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"--percentile_alpha must be in (0, 1], got {self.alpha}")
        if self.batch_size <= 0:
            raise ValueError(f"--calib_batch_size must be positive, got {self.batch_size}")


@dataclass
class CalibrationResult:
    scales: list[LayerScales]
    info: dict


def layer_keys(prefix_hashes: list[str], windows: torch.Tensor, settings: CalibrationSettings,
                prep: str) -> list[str]:
    tokens = hashlib.sha256(windows.to(torch.int64).numpy().tobytes()).hexdigest()
    common = json.dumps({"version": CALIB_VERSION, "settings": asdict(settings), "tokens": tokens, "prep": prep},
                        sort_keys=True)
    return [hashlib.sha256(f"{common}|{h}".encode()).hexdigest() for h in prefix_hashes]


