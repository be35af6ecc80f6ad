"""The on-disk format: one .npz of arrays plus a _stats.json manifest, written atomically.

Array keys (all float32 unless noted):

    mode_{mode}_input | _output | _residual   layer 0: block input, mixer output, residual after
    mode_{mode}__L{i}.{point}                 any other capture point (capture.POINTS), e.g. mode_2-4__L0.ssm.u,
                                              and L{i}.block.isolated (--isolated)
    mode_{mode}__logits                       --end-to-end: [batch, seq, vocab] (a leading sample axis with --samples N > 1)
    token_ids                                 int64 [1, seq_len]
    timestamp, model, pretrained_dir (str), seq_len (int)   scalar metadata of the research tool

Mode names never contain "_", so keys parse unambiguously. With ``--dedup`` a tap array that is
bit-identical to one written before it is stored once; the manifest's "aliases"
maps the missing key to the stored one and ``load_capture`` resolves it.

Schema versions of the manifest (``schema_version``):
    1  harness 0.1.0: first version.
    2  adds ``npz`` = {"file", "sha256", "bytes"}: the content hash of the .npz it belongs to;
       modes.{mode} also holds the research tool's layout: "input" and "output" (layer 0), each with
       shape, first_10, mean, std, min, max (``research_stats``), beside "tensors".
    3  non-finite numbers as JSON numbers (1e999, -1e999) and null for NaN instead of strings; tap
       arrays deduplicated only when asked (``--dedup``), so every key ``np.load`` users expect exists.
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
from pathlib import Path

import numpy as np

from .files import (StorageError, TrailingSha256, atomic_write, check_output, check_writable, file_sha256,
    fsync_dir, open_regular, remove_files, same_file, temp_file, write_file)
from ..emulation.capture import array_key, parse_array_key, tensor_name  # the one naming authority
from ..runtime.guard import Progress, deferred_signals, fault_point

__all__ = ["SCHEMA_VERSION", "SUPPORTED_SCHEMA_VERSIONS", "StorageError", "array_key", "parse_array_key",
           "tensor_name", "stats_path", "write_npz", "write_json", "read_json", "dedup_arrays",
           "check_writable", "json_safe", "json_text", "METADATA_KEYS", "write_pair", "check_output",
           "pending_path", "file_sha256", "MAX_MANIFEST_BYTES", "RESEARCH_STAT_KEYS",
           "research_stats", "PairWriter", "array_digest", "check_json_output", "is_capture_stats"]

SCHEMA_VERSION = 3
SUPPORTED_SCHEMA_VERSIONS = (0, 1, 2, 3)
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


# Strict JSON has no Infinity or NaN. Since schema 3 an infinity is written as the JSON number 1e999
# (-1e999), which every JSON parser reads as a number and Python, numpy and JavaScript read as +-inf
# (so `stats[...]["sqnr_db"] == float("inf")` and `np.isinf` work), and a NaN as null. Schema 1-2
# wrote the strings "inf", "-inf", "nan"; readers accept both (report.data restores them).
_INF_MARK = "\x00inf\x00"  # a string no stats value can hold (paths and argv cannot contain NUL)
_NEG_INF_MARK = "\x00-inf\x00"


def json_safe(obj):
    """Non-finite floats in the on-disk convention: +-inf as markers that ``json_text`` writes as the
    numbers 1e999 / -1e999, NaN as None (null)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None if math.isnan(obj) else (_INF_MARK if obj > 0 else _NEG_INF_MARK)
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def json_text(obj, indent: int | None = 2) -> str:
    """Strict JSON of `obj` with non-finite numbers as 1e999, -1e999 and null (see ``json_safe``)."""
    text = json.dumps(json_safe(obj), indent=indent, allow_nan=False)
    mark = json.dumps(_INF_MARK)
    return text.replace(json.dumps(_NEG_INF_MARK), "-1e999").replace(mark, "1e999")


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
    return (json_text(obj) + "\n").encode("utf-8")


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
    A member that could not be written (StorageError, OSError: a full disk) is named in ``storage_failure``.
    """

    def __init__(self, path: Path, compress: bool = False, dedup: bool = False, progress: Progress | None = None) -> None:
        self.path = Path(path)
        self.method = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
        self.dedup, self.aliases, self.keys = dedup, {}, []
        self._seen: dict[bytes, str] = {}
        self._tmp: str | None = None
        self._file = self._zip = self._hash = None
        self.stats: dict | None = None
        self.storage_failure: str | None = None  # the first member that could not be written (disk full, I/O error)
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
        try:
            check_writable(self.path, arr.nbytes)
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = self.method
            with self._zip.open(info, "w", force_zip64=True) as fh:
                np.lib.format.write_array(fh, arr, allow_pickle=False)
            self._file.flush()  # the member is complete (zipfile rewrote its header): hash it behind the writer
        except (StorageError, OSError) as e:  # a full disk: the caller must not commit over a complete old pair
            self.storage_failure = self.storage_failure or f"{key}: {type(e).__name__}: {e}"
            raise
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


def is_capture_stats(path: Path) -> bool:
    """Whether `path` is a capture's stats file: ``<name>_stats.json`` or ``.<name>_stats.json.pending`` beside
    a ``<name>.npz`` (written there, it would be read as that capture's manifest), or a JSON object with
    ``schema_version`` or ``npz``."""
    path = Path(path)
    name = path.name[1:-len(".pending")] if path.name.startswith(".") and path.name.endswith(".pending") else path.name
    if name.endswith("_stats.json") and os.path.lexists(path.with_name(name[:-len("_stats.json")] + ".npz")):
        return True
    try:
        with open_regular(path) as f:
            if not f.read(64).lstrip().startswith(b"{"):
                return False
        return bool({"schema_version", "npz"} & set(read_json(path)))
    except (OSError, StorageError):
        return False


def check_json_output(path: Path, captures: dict[str, Path | None]) -> None:
    """Refuse (StorageError) the --json path of a command that reads `captures` ("the capture" -> .npz), before any
    work: a path that cannot be written or is a special file, one of the captures' own files (the .npz, its
    _stats.json, its pending stats), any existing .npz or any capture's stats file (``is_capture_stats``). A previous --json
    output (or any other file) is replaced."""
    path = Path(path)
    check_writable(path)
    for what, npz in captures.items():
        if npz is None:
            continue
        for kind, other in ((" file", npz), ("'s stats file", stats_path(npz)),
                            ("'s pending stats file", pending_path(npz))):
            if same_file(path, other):
                raise StorageError(f"cannot write {path}: it is {what}{kind} of this run ({other}); the output "
                                   f"is never written over a file the command reads: choose another path")
    if path.name.endswith(".npz") and os.path.lexists(path):
        raise StorageError(f"cannot write {path}: it is a capture file (.npz), so it is left alone: choose "
                           f"another path, e.g. comparison.json")
    if is_capture_stats(path):
        raise StorageError(f"cannot write {path}: it is a capture's stats file (the manifest of the .npz beside it, "
                           f"or a JSON with schema_version/npz fields), so it is left alone: choose another path")
