"""The on-disk format: one .npz of arrays plus a _stats.json manifest, written atomically.

Array keys (all float32 unless noted):

    mode_{mode}_input | _output | _residual   layer 0: block input, mixer output, residual after
    mode_{mode}__L{i}.{point}                 any other capture point (capture.POINTS), e.g. mode_2-4__L0.ssm.u
    token_ids                                 int64 [1, seq_len]
    timestamp, model, pretrained_dir (str), seq_len (int)   scalar metadata of the research tool

Mode names never contain "_", so keys parse unambiguously. A tap array that is
bit-identical to one written before it is stored once; the manifest's "aliases"
maps the missing key to the stored one and ``load_capture`` resolves it.

Schema versions of the manifest (``schema_version``):
    1  harness 0.1.0: first version.
    2  modes.{mode} also holds the research tool's layout: "input" and "output" (layer 0), each with
       shape, first_10, mean, std, min, max (``research_stats``), beside "tensors".
Files without a manifest (the research tool's) are read as version 0.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

__all__ = ["SCHEMA_VERSION", "SUPPORTED_SCHEMA_VERSIONS", "StorageError", "array_key", "parse_array_key",
           "tensor_name", "stats_path", "write_npz", "write_json", "read_json", "dedup_arrays", "load_capture",
           "CaptureFile", "check_writable", "json_safe", "METADATA_KEYS", "RESEARCH_STAT_KEYS", "research_stats"]

SCHEMA_VERSION = 2
SUPPORTED_SCHEMA_VERSIONS = (0, 1, 2)
# stats["modes"][mode]["input" | "output"] of the research tool's _stats.json (save_first_layer_io.py:322-341)
RESEARCH_STAT_KEYS = ("shape", "first_10", "mean", "std", "min", "max")
METADATA_KEYS = ("timestamp", "model", "pretrained_dir", "seq_len")
_LAYER0_NAMES = {"L0.block.in": "input", "L0.block.out": "output", "L0.block.residual": "residual"}
_KEY_RE = re.compile(r"^mode_([^_]+)_(input|output|residual)$|^mode_([^_]+)__(L\d+\..+)$")


class StorageError(ValueError):
    """A capture file is missing, corrupted or of an unsupported version."""


def tensor_name(point: str) -> str:
    """Capture point -> tensor name: layer-0 block I/O keep the research tool's names."""
    return _LAYER0_NAMES.get(point, point)


def array_key(mode: str, tensor: str) -> str:
    return f"mode_{mode}_{tensor}" if tensor in ("input", "output", "residual") else f"mode_{mode}__{tensor}"


def parse_array_key(key: str) -> tuple[str, str] | None:
    m = _KEY_RE.match(key)
    if not m:
        return None
    return (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))


def research_stats(tensors: dict[str, dict]) -> dict[str, dict]:
    """{"input": {...}, "output": {...}}: the research tool's per-mode layout, from the tensors' statistics."""
    return {name: {k: tensors[name][k] for k in RESEARCH_STAT_KEYS}
            for name in ("input", "output") if name in tensors}


def stats_path(npz_path: Path) -> Path:
    npz_path = Path(npz_path)
    stem = npz_path.name[:-4] if npz_path.name.endswith(".npz") else npz_path.name
    return npz_path.with_name(f"{stem}_stats.json")


def json_safe(obj):
    """Replace non-finite floats by the strings "inf", "-inf", "nan" (strict JSON has no such numbers)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def check_writable(path: Path, nbytes: int = 0) -> None:
    """Fail before any work if `path` cannot be written or its disk lacks `nbytes` (+10%) of space."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise StorageError(f"cannot write {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise StorageError(f"cannot write {path}: directory {parent} is not writable")
    if path.is_dir():
        raise StorageError(f"cannot write {path}: it is a directory")
    free = shutil.disk_usage(parent).free
    if nbytes and free < nbytes * 1.1:
        raise StorageError(f"not enough disk space for {path}: about {nbytes / 2**20:.1f} MiB needed, "
                           f"{free / 2**20:.1f} MiB free in {parent}")


def _atomic(path: Path, write) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent if str(path.parent) else ".")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_npz(path: Path, arrays: dict[str, np.ndarray], compress: bool = False) -> None:
    """All arrays in one .npz (what np.savez writes), via a temporary file renamed into place.

    Zip entries carry a fixed date, so equal arrays give byte-identical files.
    """
    nbytes = sum(np.asarray(a).nbytes for a in arrays.values())
    check_writable(path, nbytes)
    method = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED

    def write(f) -> None:
        with zipfile.ZipFile(f, "w", compression=method, allowZip64=True) as zf:
            for key, arr in arrays.items():
                info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
                info.compress_type = method
                with zf.open(info, "w", force_zip64=True) as fh:
                    np.lib.format.write_array(fh, np.asanyarray(arr), allow_pickle=False)

    _atomic(path, write)


def write_json(path: Path, obj: dict) -> None:
    text = json.dumps(json_safe(obj), indent=2, allow_nan=False) + "\n"
    _atomic(path, lambda f: f.write(text.encode("utf-8")))


def read_json(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StorageError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise StorageError(f"{path} does not hold a JSON object")
    return data


def dedup_arrays(arrays: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Drop tap arrays ("__" keys) that equal an earlier array; returns (kept arrays, aliases)."""
    seen: dict[tuple, str] = {}
    kept: dict[str, np.ndarray] = {}
    aliases: dict[str, str] = {}
    for key, arr in arrays.items():
        arr = np.asarray(arr)
        sig = (arr.dtype.str, arr.shape, hashlib.sha256(arr.tobytes()).digest())
        if "__" in key and sig in seen:
            aliases[key] = seen[sig]
            continue
        seen.setdefault(sig, key)
        kept[key] = arr
    return kept, aliases


@dataclass
class CaptureFile:
    """A loaded capture: arrays by mode and tensor, the manifest (None for research-tool files)."""

    path: Path
    npz: "np.lib.npyio.NpzFile"
    manifest: dict | None
    aliases: dict[str, str] = field(default_factory=dict)
    index: dict[str, dict[str, str]] = field(default_factory=dict)  # mode -> tensor -> stored key

    def modes(self) -> list[str]:
        return list(self.index)

    def tensors(self, mode: str) -> list[str]:
        return list(self.index.get(mode, {}))

    def array(self, mode: str, tensor: str) -> np.ndarray:
        try:
            return self.npz[self.index[mode][tensor]]
        except (KeyError, ValueError, OSError, zipfile.BadZipFile, EOFError) as e:
            raise StorageError(f"{self.path}: cannot read array {array_key(mode, tensor)} ({e})") from None

    def tensor_meta(self, mode: str, tensor: str) -> dict:
        if not self.manifest:
            return {}
        return self.manifest.get("modes", {}).get(mode, {}).get("tensors", {}).get(tensor, {})


def load_capture(path: Path) -> CaptureFile:
    """Open a capture .npz (never unpickling) and its _stats.json manifest if there is one."""
    path = Path(path)
    if not path.is_file():
        raise StorageError(f"capture file {path} does not exist")
    try:
        npz = np.load(path, allow_pickle=False)
        keys = list(npz.keys())
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as e:
        raise StorageError(f"{path} is not a readable .npz file ({type(e).__name__}: {e})") from None
    manifest = read_json(stats_path(path)) if stats_path(path).is_file() else None
    if manifest is not None:
        version = manifest.get("schema_version", 0)
        if version not in SUPPORTED_SCHEMA_VERSIONS:
            raise StorageError(f"{stats_path(path)}: schema_version {version!r} is not supported; "
                               f"supported: {', '.join(map(str, SUPPORTED_SCHEMA_VERSIONS))}")
    aliases = dict((manifest or {}).get("aliases", {}))
    index: dict[str, dict[str, str]] = {}
    for key in keys + [k for k in aliases if k not in keys]:
        parsed = parse_array_key(key)
        if parsed is not None:
            index.setdefault(parsed[0], {})[parsed[1]] = aliases.get(key, key)
    if manifest and manifest.get("modes"):  # manifest order (the run's order) first
        ordered = {m: index[m] for m in manifest["modes"] if m in index}
        index = {**ordered, **{m: v for m, v in index.items() if m not in ordered}}
    return CaptureFile(path, npz, manifest, aliases, index)
