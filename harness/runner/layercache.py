"""One checksummed, atomic per-layer cache, shared by every recipe (calibration scales and their observers'
state, lm_head's input scale, GPTQ's int4 weights).

One format for every entry: ``<cache_dir>/<kind>-<key[:40]>.v<VERSION>.npz``, an uncompressed .npz (np.savez)
holding the entry's arrays under their own names and one more member, ``__entry__``: a uint8 array of the UTF-8
JSON header ``{"format", "version", "kind", "key", "payload", "arrays", "checksum"}``. ``payload`` is the recipe's
JSON dict; ``arrays`` names each array's dtype and shape; ``checksum`` is the SHA-256 of the header's JSON (without
the checksum, keys sorted) followed by every array's name, dtype, shape and bytes, in name order, so an edited
payload or array, a renamed or dropped member fails it. An entry without arrays is the header alone.

Reading trusts nothing in the file: it must be a regular file (a FIFO, a device or a directory at the path is
refused before a byte is read: store.files.open_regular) of at most ``max_bytes`` bytes, its members (and their
uncompressed sizes) too; it is read with ``np.load(..., allow_pickle=False)`` (never a pickle); then the format
tag, version, kind, key, the members against the header and the checksum are checked. ``read`` gives None when no
file is there and raises BadEntry naming the reason for any other file that is not a valid entry for that key (a
header nested too deep to parse is one of them); ``read_layers`` reads layers 0, 1, ... and turns a bad entry
into a problem to report (the caller warns and recomputes, and never uses it).

Writing goes through a temporary file in the same directory, fsync'd and renamed over the entry
(store.files.atomic_write): the entry is the old one or the new one, and no temporary file is left behind on an
exception; an OSError is the caller's to report. Files of the caches before this one (``calib-*.json``,
``gptq-<key>.npz``) have other names: they are never found, so never misread (bump VERSION likewise).
"""
from __future__ import annotations

import hashlib
import json
import os
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TypeVar

import numpy as np

from ..store.files import atomic_write, open_regular

__all__ = ["LayerCache", "Entry", "BadEntry", "FORMAT", "VERSION"]

FORMAT = "quamba-harness-layer-cache"
VERSION = 1  # bump when the layout of an entry changes: entries of another version have other names
_HEADER = "__entry__"
_MAX_MEMBERS = 64
_UNREADABLE = (OSError, ValueError, EOFError, KeyError, TypeError, zipfile.BadZipFile, zlib.error,
               NotImplementedError, RuntimeError)
T = TypeVar("T")


class BadEntry(ValueError):
    """A file at an entry's path that is not a valid entry for its key; the message is the reason."""


@dataclass(frozen=True)
class Entry:
    key: str
    payload: dict
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


def _digest(header: dict, arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256(json.dumps(header, sort_keys=True).encode())
    for name in sorted(arrays):
        a = arrays[name]
        h.update(f"\0{name}\0{a.dtype.str}\0{list(a.shape)}\0".encode())
        h.update(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)
    return h.hexdigest()


class LayerCache:
    """The entries of one kind ("calib", "gptq", ...) in cache_dir (None: no cache: nothing read or written);
    max_bytes caps an entry's file (and its members' uncompressed sizes)."""

    def __init__(self, cache_dir: Path | None, kind: str, *, max_bytes: int = 1 << 24) -> None:
        if not kind or "/" in kind:
            raise ValueError(f"a cache kind is a non-empty name without '/', got {kind!r}")
        self.cache_dir = None if cache_dir is None else Path(cache_dir)
        self.kind, self.max_bytes = kind, max_bytes

    @property
    def enabled(self) -> bool:
        return self.cache_dir is not None

    def path(self, key: str) -> Path:
        if self.cache_dir is None:
            raise ValueError("this cache has no directory (caching is off)")
        return self.cache_dir / f"{self.kind}-{key[:40]}.v{VERSION}.npz"

    def read(self, key: str) -> Entry | None:
        """The entry under `key`; None when no file is there (nor its directory); BadEntry for any other file."""
        try:
            return self._read(self.path(key), key)
        except RecursionError:
            raise BadEntry("nested too deeply to be a cache entry (RecursionError)") from None

    def _read(self, path: Path, key: str) -> Entry | None:
        try:
            f = open_regular(path, lambda what: BadEntry(f"it is {what}"))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise BadEntry(f"unreadable ({type(e).__name__}: {e.strerror})") from None
        with f:
            if os.fstat(f.fileno()).st_size > self.max_bytes:
                raise BadEntry(f"it is larger than {self.max_bytes} bytes")
            header, arrays = self._load(f)
        return self._check(header, arrays, key)

    def _load(self, f) -> tuple[object, dict[str, np.ndarray]]:
        try:
            if f.read(4) != b"PK\x03\x04":
                raise BadEntry("not a cache entry (not an .npz file)")
            f.seek(0)
            z = np.load(f, allow_pickle=False)
            with z:
                infos = z.zip.infolist()
                if len(infos) > _MAX_MEMBERS or sum(i.file_size for i in infos) > self.max_bytes:
                    raise BadEntry(f"its members hold more than {self.max_bytes} bytes or {_MAX_MEMBERS} arrays")
                if _HEADER not in z.files:
                    raise BadEntry("not a cache entry (no header)")
                raw = z[_HEADER]
                if raw.dtype != np.uint8 or raw.ndim != 1:
                    raise BadEntry("not a cache entry (the header is not bytes)")
                header = json.loads(raw.tobytes().decode("utf-8"))
                arrays = {name: z[name] for name in z.files if name != _HEADER}
        except (BadEntry, RecursionError):
            raise
        except _UNREADABLE as e:
            raise BadEntry(f"unreadable ({type(e).__name__}: {e})") from None
        return header, arrays

    def _check(self, header: object, arrays: dict[str, np.ndarray], key: str) -> Entry:
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise BadEntry("not a cache entry (another format)")
        if header.get("version") != VERSION:
            raise BadEntry(f"version {header.get('version')!r}, this harness reads version {VERSION}")
        want = {name: [a.dtype.str, list(a.shape)] for name, a in arrays.items()}
        body = {k: v for k, v in header.items() if k != "checksum"}
        if header.get("arrays") != want or header.get("checksum") != _digest(body, arrays):
            raise BadEntry("checksum mismatch (the file was modified or truncated)")
        if header.get("kind") != self.kind:
            raise BadEntry(f"kind mismatch (a {header.get('kind')!r} entry, not {self.kind!r})")
        if header.get("key") != key:
            raise BadEntry("key mismatch")
        if not isinstance(header.get("payload"), dict):
            raise BadEntry("not a cache entry (no payload)")
        return Entry(key, header["payload"], arrays)

    def write(self, key: str, payload: dict, arrays: dict[str, np.ndarray] | None = None) -> Path:
        """Write the entry under `key` atomically (module docstring); its path. OSError when it cannot be written."""
        arrays = {name: np.asarray(a) for name, a in (arrays or {}).items()}
        for name, a in arrays.items():
            if name == _HEADER or not name or "/" in name or a.dtype.hasobject:
                raise ValueError(f"cannot cache array {name!r} of dtype {a.dtype}")
        body = {"format": FORMAT, "version": VERSION, "kind": self.kind, "key": key, "payload": payload,
                "arrays": {name: [a.dtype.str, list(a.shape)] for name, a in arrays.items()}}
        header = json.dumps({**body, "checksum": _digest(body, arrays)}, sort_keys=True).encode()
        members = {**arrays, _HEADER: np.frombuffer(header, dtype=np.uint8)}
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: np.savez(f, **members))
        return path

    def read_layers(self, keys: list[str], parse: Callable[[int, Entry], T], what: str) -> tuple[list[T], list[str]]:
        """parse(layer, entry) of layers 0, 1, ... up to the first missing or bad entry (parse raises ValueError
        for an entry that does not fit), and the problems found ("layer 1 <what> <path> is corrupted: <reason>").
        Nothing is read without a cache directory."""
        got: list[T] = []
        if self.cache_dir is None:
            return got, []
        for layer, key in enumerate(keys):
            try:
                entry = self.read(key)
                if entry is None:
                    break
                got.append(parse(layer, entry))
            except ValueError as e:
                return got, [f"layer {layer} {what} {self.path(key)} is corrupted: {e}"]
        return got, []

    def write_layers(self, keys: list[str], entries: list[tuple[dict, dict[str, np.ndarray] | None]]) -> list[str]:
        """Write one entry per layer (payload, arrays); their paths. OSError at the first that cannot be written."""
        return [str(self.write(key, payload, arrays)) for key, (payload, arrays) in zip(keys, entries)]
