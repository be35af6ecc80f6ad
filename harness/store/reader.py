"""Reading a capture: the .npz (never unpickling) with the _stats.json manifest that belongs to it.

``load_capture(path)`` is the one way to read our files and the research tool's: it checks that the
manifest belongs to the .npz (its recorded sha256), that the manifest has the schema readers rely on
(``store.schema``), resolves deduplicated keys (``--dedup``) and layer 0's research-tool names, and
checks every member's header before numpy allocates it (``store.members``).
"""
from __future__ import annotations

import os
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .files import StorageError, file_kind, file_sha256
from .format import SUPPORTED_SCHEMA_VERSIONS, pending_path, read_json, stats_path
from .members import check_member
from .schema import check_stats
from ..emulation.capture import array_key, parse_array_key, tensor_name

__all__ = ["CaptureFile", "load_capture"]


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

    def key(self, mode: str, tensor: str) -> str:
        """The stored key of a mode's tensor. `tensor` is a tensor name ("output", "L1.ssm.u") or a capture
        point ("L0.block.out" is stored as "output"); a name the file lacks is a StorageError listing what
        it holds."""
        tensors = self.index.get(mode)
        if tensors is None:
            raise StorageError(f"{self.path}: no mode {mode!r} in the file; modes: {', '.join(self.index) or '(none)'}")
        name = tensor if tensor in tensors else tensor_name(tensor)
        if name not in tensors:
            names = list(tensors)
            shown = ", ".join(names[:40]) + (f", ... ({len(names)} in all)" if len(names) > 40 else "")
            raise StorageError(f"{self.path}: mode {mode} has no tensor {tensor!r}; it has: {shown}")
        return tensors[name]

    def array(self, mode: str, tensor: str) -> np.ndarray:
        """The stored array (`tensor` as for ``key``); a member that is not a numeric array of at least one
        axis (object, string, a 0-d scalar, corrupted bytes, a header declaring more data than the member
        holds) is a StorageError naming the member: a bad file."""
        key = self.key(mode, tensor)
        check_member(self.npz.zip, f"{key}.npy", f"{self.path}: cannot read array {array_key(mode, tensor)}")
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
        """The tensor's stats entry ({} when there is none); `tensor` as for ``key``."""
        if not self.manifest:
            return {}
        tensors = self.manifest.get("modes", {}).get(mode, {}).get("tensors", {})
        return tensors.get(tensor, tensors.get(tensor_name(tensor), {}))


def _check_manifest(spath: Path, manifest: dict) -> None:
    """A supported version whose fields have the types readers expect (``store.schema``)."""
    version = manifest.get("schema_version", 0)
    if version not in SUPPORTED_SCHEMA_VERSIONS:
        raise StorageError(f"{spath}: schema_version {version!r} is not supported; "
                           f"supported: {', '.join(map(str, SUPPORTED_SCHEMA_VERSIONS))}")
    check_stats(manifest, str(spath))


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
