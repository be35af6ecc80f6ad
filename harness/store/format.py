"""The on-disk format: one .npz of arrays plus a _stats.json manifest, written atomically.

Array keys (all float32 unless noted):

    mode_{mode}_input | _output | _residual   layer 0: block input, mixer output, residual after
    mode_{mode}__L{i}.{point}                 any other capture point (capture.POINTS), e.g. mode_2-4__L0.ssm.u,
                                              and L{i}.block.isolated (--isolated)
    mode_{mode}__logits                       --end-to-end: [batch, seq, vocab] (a leading sample axis with --samples N > 1)
    token_ids                                 int64 [1, seq_len]
    timestamp, model, pretrained_dir (str), seq_len (int)   scalar metadata of the research tool

Mode names never contain "_", so keys parse unambiguously. A tap array that is
bit-identical to one written before it is stored once; the manifest's "aliases"
maps the missing key to the stored one and ``load_capture`` resolves it.

Schema versions of the manifest (``schema_version``):
    1  harness 0.1.0: first version.
    2  adds ``npz`` = {"file", "sha256", "bytes"}: the content hash of the .npz it belongs to;
       modes.{mode} also holds the research tool's layout: "input" and "output" (layer 0), each with
       shape, first_10, mean, std, min, max (``research_stats``), beside "tensors".
Files without a manifest (the research tool's) are read as version 0.

The pair is one unit (``write_pair``): the .npz goes to a temporary file, is fsynced and hashed;
the manifest (with that hash) goes to ``.<name>_stats.json.pending``; then, with SIGINT/SIGTERM
deferred, the .npz is renamed into place and the pending manifest renamed over ``_stats.json``:
that last rename is the commit point. A reader (``load_capture``) checks the hash: a match is a
complete pair; a mismatch with a matching pending manifest (a run killed between the two renames)
is the new pair, read with the pending manifest; any other mismatch is refused with the reason.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .files import (StorageError, TrailingSha256, atomic_write, check_output, check_writable, file_kind, file_sha256,
    fsync_dir, open_regular, remove_files, temp_file, write_file)
from ..emulation.capture import array_key, parse_array_key, tensor_name  # the one naming authority
from ..runtime.guard import Progress, deferred_signals, fault_point

__all__ = ["SCHEMA_VERSION", "SUPPORTED_SCHEMA_VERSIONS", "StorageError", "array_key", "parse_array_key",
           "tensor_name", "stats_path", "write_npz", "write_json", "read_json", "dedup_arrays", "load_capture",
           "CaptureFile", "check_writable", "json_safe", "METADATA_KEYS", "write_pair", "check_output",
           "pending_path", "file_sha256", "MAX_MANIFEST_BYTES", "RESEARCH_STAT_KEYS",
           "research_stats", "PairWriter", "array_digest"]

SCHEMA_VERSION = 2
SUPPORTED_SCHEMA_VERSIONS = (0, 1, 2)
MAX_MANIFEST_BYTES = 1 << 30
# stats["modes"][mode]["input" | "output"] of the research tool's _stats.json (save_first_layer_io.py:322-341)
RESEARCH_STAT_KEYS = ("shape", "first_10", "mean", "std", "min", "max")
METADATA_KEYS = ("timestamp", "model", "pretrained_dir", "seq_len")
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


def _npz_writer(arrays: dict[str, np.ndarray], compress: bool):
    method = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED

    def write(f) -> None:
        with zipfile.ZipFile(f, "w", compression=method, allowZip64=True) as zf:
            for n, (key, arr) in enumerate(arrays.items()):
                info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
                info.compress_type = method
                with zf.open(info, "w", force_zip64=True) as fh:
                    np.lib.format.write_array(fh, np.asanyarray(arr), allow_pickle=False)
                if n == 0:
                    fault_point("write-npz")
    return write


def write_npz(path: Path, arrays: dict[str, np.ndarray], compress: bool = False) -> None:
    """All arrays in one .npz (what np.savez writes), via a temporary file renamed into place.

    Zip entries carry a fixed date, so equal arrays give byte-identical files.
    """
    nbytes = sum(np.asarray(a).nbytes for a in arrays.values())
    check_writable(path, nbytes)
    atomic_write(path, _npz_writer(arrays, compress))


def _json_bytes(obj: dict) -> bytes:
    return (json.dumps(json_safe(obj), indent=2, allow_nan=False) + "\n").encode("utf-8")


def write_json(path: Path, obj: dict) -> None:
    text = _json_bytes(obj)
    atomic_write(path, lambda f: f.write(text))


def pending_path(npz_path: Path) -> Path:
    """Where the manifest waits between the two renames of ``write_pair``."""
    spath = stats_path(npz_path)
    return spath.with_name(f".{spath.name}.pending")


class PairWriter:
    """The .npz of a pair written member by member as results arrive, then committed with its manifest.

    ``add(key, array)`` appends one .npy member to a temporary .npz next to the target (nothing is held
    in memory after it returns; a worker thread hashes finished members, files.TrailingSha256);
    ``commit(stats)`` closes and fsyncs it, hashes the rest and commits the pair exactly as ``write_pair``
    (pending manifest, then the two renames with signals deferred). Leaving the ``with`` block without a
    commit (an exception, a signal) removes the temporary file: the previous pair is untouched. With
    ``dedup``, an array ("__" key) bit-identical to one added before is not stored again; ``aliases`` maps it.
    """

    def __init__(self, path: Path, compress: bool = False, dedup: bool = False, progress: Progress | None = None) -> None:
        self.path = Path(path)
        self.method = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
        self.dedup, self.aliases, self.keys = dedup, {}, []
        self._seen: dict[bytes, str] = {}
        self._tmp: str | None = None
        self._file = self._zip = self._hash = None
        self.stats: dict | None = None
        self.progress = progress  # told when the pair is committed (what an interruption kept)

    def __enter__(self) -> "PairWriter":
        check_writable(self.path)
        check_writable(stats_path(self.path))
        self._tmp = temp_file(self.path)
        self._file = open(self._tmp, "wb")
        self._hash = TrailingSha256(self._tmp)
        self._zip = zipfile.ZipFile(self._file, "w", compression=self.method, allowZip64=True)
        return self

    def add(self, key: str, arr, digest: bytes | None = None) -> None:
        """Append one member; `digest`: the array's ``array_digest`` when the caller has it already."""
        arr = np.asanyarray(arr)
        if self.dedup:
            sig = digest if digest is not None else array_digest(arr)
            if "__" in key and sig in self._seen:
                self.aliases[key] = self._seen[sig]
                return
            self._seen.setdefault(sig, key)
        check_writable(self.path, arr.nbytes)
        info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
        info.compress_type = self.method
        with self._zip.open(info, "w", force_zip64=True) as fh:
            np.lib.format.write_array(fh, arr, allow_pickle=False)
        self._file.flush()  # the member is complete (zipfile rewrote its header): hash it behind the writer
        self._hash.final(self._file.tell())
        self.keys.append(key)
        if len(self.keys) == 1:
            fault_point("write-npz")

    def commit(self, stats: dict) -> dict:
        """Close the .npz and commit the pair; returns the manifest written (with ``npz``)."""
        self._zip.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        spath, pending = stats_path(self.path), pending_path(self.path)
        stats = {**stats, "npz": {"file": self.path.name, "sha256": self._hash.hexdigest(),
                                  "bytes": os.path.getsize(self._tmp)}}
        tmp_stats = temp_file(spath)
        npz_renamed = False
        try:
            body = _json_bytes(stats)
            write_file(tmp_stats, lambda f: f.write(body), fault="write-stats")
            os.replace(tmp_stats, pending)
            with deferred_signals():
                os.replace(self._tmp, self.path)
                npz_renamed = True
                fault_point("between-renames")
                os.replace(pending, spath)
                if self.progress is not None:
                    self.progress.committed = True
            fsync_dir(self.path.parent)
        finally:
            remove_files(tmp_stats)
            if not npz_renamed:
                remove_files(pending)
        self._tmp, self.stats = None, stats
        return stats

    def __exit__(self, *exc) -> None:
        if self._hash is not None:  # waits for the worker
            self._hash.close()
        if self._tmp is not None:
            try:
                if self._zip is not None:
                    self._zip.close()
            except Exception:  # a half-written member: the file is removed anyway
                pass
            if self._file is not None and not self._file.closed:
                self._file.close()
            remove_files(self._tmp)
            self._tmp = None


def write_pair(path: Path, arrays: dict[str, np.ndarray], stats: dict, compress: bool = False) -> dict:
    """Write the .npz and its _stats.json as one unit (see the module docstring); returns the stats written.

    The manifest gets ``npz`` = {"file", "sha256", "bytes"}. On any exception or signal
    before the commit the previous pair is untouched and no temporary file is left.
    """
    path = Path(path)
    check_writable(path, sum(np.asarray(a).nbytes for a in arrays.values()))
    with PairWriter(path, compress) as writer:
        for key, arr in arrays.items():
            writer.add(key, arr)
        return writer.commit(stats)


def read_json(path: Path) -> dict:
    path = Path(path)
    try:
        with open_regular(path) as f:  # a special file is refused unread
            size = os.fstat(f.fileno()).st_size
            if size > MAX_MANIFEST_BYTES:
                raise StorageError(f"cannot read {path}: {size} bytes is more than a stats file can be "
                                   f"({MAX_MANIFEST_BYTES} bytes)")
            data = json.loads(f.read(MAX_MANIFEST_BYTES + 1).decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise StorageError(f"cannot read {path}: {type(e).__name__}: {e}") from None
    if not isinstance(data, dict):
        raise StorageError(f"{path} does not hold a JSON object")
    return data


def array_digest(arr) -> bytes:
    """sha256 of an array's dtype, shape and bytes in C order (no copy of a contiguous array): equal
    digests, equal arrays. Deduplication and the bit-identical groups of modes rest on it."""
    arr = np.asarray(arr)
    h = hashlib.sha256(f"{arr.dtype.str}{arr.shape}".encode())
    h.update(np.ascontiguousarray(arr))
    return h.digest()


def dedup_arrays(arrays: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Drop tap arrays ("__" keys) that equal an earlier array; returns (kept arrays, aliases)."""
    seen: dict[bytes, str] = {}
    kept: dict[str, np.ndarray] = {}
    aliases: dict[str, str] = {}
    for key, arr in arrays.items():
        arr = np.asarray(arr)
        sig = array_digest(arr)
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
        """The stored array; a member that is not a numeric array of at least one axis (object, string, a 0-d
        scalar, corrupted bytes or compressed stream) is a StorageError naming the member: a bad file."""
        key = self.index.get(mode, {}).get(tensor)
        try:
            arr = self.npz[key]
        except (KeyError, ValueError, OSError, zipfile.BadZipFile, EOFError, TypeError, zlib.error) as e:
            raise StorageError(f"{self.path}: cannot read array {array_key(mode, tensor)} (member {key}.npy, "
                               f"{type(e).__name__}: {e})") from None
        if not isinstance(arr, np.ndarray):
            raise StorageError(f"{self.path}: cannot read array {key}: member {key}.npy is not a .npy array")
        if arr.dtype.kind not in "fiub":
            raise StorageError(f"{self.path}: array {key} has dtype {arr.dtype}; capture arrays are numeric "
                               f"(float, int or bool)")
        if arr.ndim == 0:
            raise StorageError(f"{self.path}: member {key}.npy holds a 0-d value ({arr.dtype} scalar), not a "
                               f"tensor; capture arrays have at least one axis ([batch, tokens, channels])")
        return arr

    def tensor_meta(self, mode: str, tensor: str) -> dict:
        if not self.manifest:
            return {}
        return self.manifest.get("modes", {}).get(mode, {}).get("tensors", {}).get(tensor, {})


def _check_manifest(spath: Path, manifest: dict) -> None:
    """The fields a reader relies on have the types it expects."""
    version = manifest.get("schema_version", 0)
    if version not in SUPPORTED_SCHEMA_VERSIONS:
        raise StorageError(f"{spath}: schema_version {version!r} is not supported; "
                           f"supported: {', '.join(map(str, SUPPORTED_SCHEMA_VERSIONS))}")
    modes, aliases = manifest.get("modes", {}), manifest.get("aliases", {})
    problem = None
    if not isinstance(modes, dict) or not all(isinstance(e, dict) for e in modes.values()):
        problem = "'modes' must map mode names to objects"
    elif not all(isinstance(e.get("tensors", {}), dict) for e in modes.values()):
        problem = "each mode's 'tensors' must be an object"
    elif not isinstance(aliases, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
        problem = "'aliases' must map array keys to array keys"
    elif "npz" in manifest and not (isinstance(manifest["npz"], dict) and isinstance(manifest["npz"].get("sha256"), str)):
        problem = "'npz' must be an object with the .npz's sha256"
    if problem:
        raise StorageError(f"{spath} is not a valid stats file: {problem}")


def _matching_manifest(path: Path) -> dict | None:
    """The manifest that belongs to the .npz at `path` (checked by sha256), None if it has none."""
    spath, pending = stats_path(path), pending_path(path)
    manifest = read_json(spath) if os.path.lexists(spath) else None
    if manifest is not None:
        _check_manifest(spath, manifest)
    recorded = (manifest or {}).get("npz", {}).get("sha256")
    if manifest is not None and recorded is None:
        return manifest  # schema 1: no hash recorded
    actual = file_sha256(path) if (recorded is not None or os.path.lexists(pending)) else None
    if recorded is not None and recorded == actual:
        return manifest
    if os.path.lexists(pending):  # killed between the two renames: the pending manifest is the new pair's
        try:
            candidate = read_json(pending)
            _check_manifest(pending, candidate)
        except StorageError:
            candidate = None
        if candidate is not None and candidate.get("npz", {}).get("sha256") == actual:
            return candidate
    if manifest is None:
        return None
    raise StorageError(f"{path} does not match {spath}: the stats file records an .npz with sha256 "
                       f"{recorded[:16]}..., the file has {actual[:16]}... (one of the two was replaced or "
                       f"modified outside the harness); re-run the capture, or move {spath.name} away to read "
                       f"the arrays without statistics")


def load_capture(path: Path) -> CaptureFile:
    """Open a capture .npz (never unpickling) and its _stats.json manifest if there is one.

    The manifest must belong to this .npz (its recorded sha256, schema 2); see ``write_pair``.
    """
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise StorageError(f"capture file {path} does not exist") from None
    except OSError as e:
        raise StorageError(f"cannot read capture file {path}: {e.strerror}") from None
    kind = file_kind(st.st_mode)
    if kind is not None:
        raise StorageError(f"capture file {path} is {kind}; give a .npz file")
    try:
        npz = np.load(path, allow_pickle=False)
        if not isinstance(npz, np.lib.npyio.NpzFile):
            raise ValueError("it holds a single array, not a .npz archive")
        keys = list(npz.keys())
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as e:
        raise StorageError(f"{path} is not a readable .npz file ({type(e).__name__}: {e})") from None
    manifest = _matching_manifest(path)
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
