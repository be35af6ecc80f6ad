"""What every benchmark script shares: the eight modes, child processes, and their peak memory.

Each measurement runs in its own process (``spawn``): the script calls itself with
``--child KIND JSON`` and reads the child's last stdout line as JSON.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

MODES = ["fp32", "0", "2-0", "2-1", "2-2", "2-3", "2-4", "3"]


def peak_mb() -> float:
    """High-water RSS of this process in MB (VmHWM: per address space, so nothing inherited from the parent)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run_child(child: list[str], children: dict) -> None:
    """The child side of ``spawn``: run children[kind](args) and print its result with this process's peak RSS."""
    out = children[child[0]](json.loads(child[1]))
    print(json.dumps({**out, "peak_mb": round(peak_mb(), 1)}))


def spawn(script: str, kind: str, args: dict) -> dict:
    """Run `script --child kind args` in a fresh process (offline); its last stdout line, parsed as JSON."""
    proc = subprocess.run([sys.executable, script, "--child", kind, json.dumps(args)], capture_output=True,
                          text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
