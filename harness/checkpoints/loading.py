"""Checkpoints and tokenizers from local directories: no network, no unpickling of arbitrary objects.

Two layouts are read:

* transformers (``state-spaces/mamba-130m-hf``): config.json with ``hidden_size``,
  ``num_hidden_layers`` ...; tensors ``backbone.embeddings.weight``,
  ``backbone.layers.{i}.mixer.*``; weights in model.safetensors (or sharded with
  model.safetensors.index.json), or pytorch_model.bin[.index.json];
* mamba_ssm (``state-spaces/mamba-130m``): config.json with ``d_model``, ``n_layer``,
  ``ssm_cfg``; tensors ``backbone.embedding.weight`` ...; weights in pytorch_model.bin.

Tensors are read lazily: safetensors files are memory-mapped and each tensor is a zero-copy view of
its bytes (``MappedSafetensors``), ``.bin`` files are read with ``torch.load(weights_only=True,
mmap=True)``; either way only the pages of the tensors that are used (the embedding rows of the sample,
the blocks up to the deepest captured one) are ever read from disk. A file that is not a regular file
(a FIFO, a device, a link to one) is refused, naming it, before it is read (``store.files``).
"""
from __future__ import annotations

import hashlib
import json
import math
import mmap
import struct
from dataclasses import asdict
from pathlib import Path
from typing import Iterator

import torch

from ..spec import ModelDims
from ..architectures.config_values import ConfigValueError, check_config_tables, config_int, config_table, parse_int
from ..architectures.registry import architecture_names, get_architecture
from ..store.files import is_regular, open_regular, read_regular

__all__ = ["ModelDirError", "Checkpoint", "MappedSafetensors", "open_checkpoint",
           "LAYER_TENSORS", "MODEL_DIR_CONTENTS", "check_dims"]

MODEL_DIR_CONTENTS = ("a model directory must contain config.json (transformers Mamba keys hidden_size, "
                      "num_hidden_layers, ... or mamba_ssm keys d_model, n_layer, ...) and weights "
                      "(model.safetensors, model.safetensors.index.json, pytorch_model.bin or "
                      "pytorch_model.bin.index.json), plus tokenizer.json unless --tokenizer is given")

# canonical name -> key suffix under backbone.layers.{i}.
LAYER_TENSORS: dict[str, str] = {
    "norm_weight": "norm.weight",
    "in_proj": "mixer.in_proj.weight",
    "conv_weight": "mixer.conv1d.weight",
    "conv_bias": "mixer.conv1d.bias",
    "x_proj": "mixer.x_proj.weight",
    "dt_proj": "mixer.dt_proj.weight",
    "dt_bias": "mixer.dt_proj.bias",
    "A_log": "mixer.A_log",
    "D": "mixer.D",
    "out_proj": "mixer.out_proj.weight",
}
_OPTIONAL = {"conv_bias"}
# the embedding's key: transformers' Mamba layouts, mamba_ssm's, and the hybrids' (Bamba, Nemotron-H)
_EMBED_KEYS = ("backbone.embeddings.weight", "backbone.embedding.weight", "model.embed_tokens.weight",
               "model.embeddings.weight")
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


class ModelDirError(ValueError):
    """The model directory is missing, incomplete or malformed; the message says what is expected."""


def refuse_in(file: Path):  # store.files.Refusal: a model directory's file that is special or too large
    return lambda what: ModelDirError(f"{file} is {what}; {MODEL_DIR_CONTENTS}")


def _hash_tensor(h, key: str, t: torch.Tensor, raw: Iterator[bytes] | None = None) -> None:
    """Feed name, dtype, shape and the little-endian bytes of t (or the same bytes read from its file)."""
    h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
    if raw is None:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().data)
    else:
        for block in raw:
            h.update(block)


class Checkpoint:
    """A Mamba-1 checkpoint directory whose tensors are read on demand."""

    def __init__(self, path: Path, key_file: dict[str, Path], embed_key: str, handles: dict[Path, object]) -> None:
        self.path, self.format, self.dims = path, "?", None  # dims: ModelDims, or Mamba2Dims (architectures.mamba2.config)
        self.layer_tensors, self.optional = LAYER_TENSORS, _OPTIONAL  # a Mamba-2's own (architectures.mamba2.config)
        # a layout whose blocks differ (a hybrid's, architectures.bamba.config): block -> {canonical name: full key};
        # None: every block has layer_tensors under backbone.layers.{i}.
        self.block_keys = None
        self.final_norm_key = "backbone.norm_f.weight"  # the final RMSNorm's weight (runner.head)
        self._key_file, self._embed_key, self._handles = key_file, embed_key, handles
        self.tensors_read: dict[str, int] = {}  # key -> bytes, for every tensor read so far
        self._embedding: torch.Tensor | None = None

    def has(self, key: str) -> bool:
        return key in self._key_file

    def keys(self) -> list[str]:
        return list(self._key_file)

    def weight_files(self) -> set[Path]:
        return set(self._key_file.values())

    def tensor(self, key: str) -> torch.Tensor:
        """One tensor in its stored dtype, read from its file."""
        if key not in self._key_file:
            raise ModelDirError(f"{self.path}: tensor {key!r} is missing from the checkpoint ({MODEL_DIR_CONTENTS})")
        file = self._key_file[key]
        if file not in self._handles:
            self.meta(key)  # opens the file, a clear error when it is corrupted
        handle = self._handles[file]
        try:
            t = handle.get_tensor(key) if hasattr(handle, "get_tensor") else handle[key]
        except (ValueError, RuntimeError, KeyError, TypeError) as e:  # truncated file, bad header entry
            raise ModelDirError(f"{file}: cannot read tensor {key!r} ({type(e).__name__}: {e})") from None
        self.tensors_read[key] = t.numel() * t.element_size()
        return t

    def meta(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of a tensor from its file's header, without reading its data."""
        file = self._key_file[key]
        try:
            handle = self._handles[file] if file in self._handles else self._handles.setdefault(file, _open_weights(file))
        except Exception as e:  # corrupted or truncated shard
            raise ModelDirError(f"{file}: cannot read weights ({type(e).__name__}: {e})") from None
        try:
            return handle.meta(key) if isinstance(handle, MappedSafetensors) else (tuple(handle[key].shape), handle[key].dtype)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ModelDirError(f"{file}: bad entry for tensor {key!r} ({type(e).__name__}: {e})") from None

    def drop_pages(self) -> None:
        for handle in (h for h in self._handles.values() if isinstance(h, MappedSafetensors)):
            handle.drop_pages()  # the resident pages of the memory-mapped weight files

    def read_summary(self) -> dict:
        """Which tensors were read, their bytes, and the size of the weight files, for provenance."""
        return {"count": len(self.tensors_read), "bytes": sum(self.tensors_read.values()),
                "checkpoint_bytes": sum(f.stat().st_size for f in set(self._key_file.values()) if f.exists()),
                "keys": sorted(self.tensors_read)}

    def layer_key(self, layer: int, name: str) -> str:
        if self.block_keys is not None:
            return self.block_keys(layer)[name]
        return f"backbone.layers.{layer}.{self.layer_tensors[name]}"

    def layer_names(self, layer: int):
        """The canonical tensor names of block `layer`."""
        return self.layer_tensors if self.block_keys is None else self.block_keys(layer)

    def raw_layer(self, layer: int) -> dict[str, torch.Tensor | None]:
        """The float tensors of block `layer` as fp32 (conv weight reshaped to (d_inner, d_conv))."""
        out = {name: None if (name in self.optional and not self.has(self.layer_key(layer, name)))
               else self.tensor(self.layer_key(layer, name)).to(torch.float32) for name in self.layer_names(layer)}
        if "conv_weight" in out:
            out["conv_weight"] = out["conv_weight"].reshape(-1, self.dims.d_conv)  # (channels, d_conv)
        return out

    def embedding(self) -> torch.Tensor:
        """(vocab_size, d_model) in the stored dtype (read once)."""
        if self._embedding is None:
            self._embedding = self.tensor(self._embed_key)
        return self._embedding

    def prefix_hashes(self, depth: int) -> list[str]:
        """sha256 chain: entry i covers the dims, the embedding and blocks 0..i (nothing deeper is read).

        Tensors enter under canonical names, so both checkpoint layouts of the same weights hash alike.
        """
        h = hashlib.sha256(json.dumps(asdict(self.dims), sort_keys=True).encode())
        _hash_tensor(h, "embedding", self.embedding(), self._raw_bytes(self._embed_key))
        out = []
        for layer in range(depth + 1):
            for name in self.layer_names(layer):
                key = self.layer_key(layer, name)
                if self.has(key):
                    _hash_tensor(h, f"{layer}.{name}", self.tensor(key), self._raw_bytes(key))
            out.append(h.copy().hexdigest())
        return out

    def _raw_bytes(self, key: str) -> Iterator[bytes] | None:
        """The tensor's bytes read straight from a safetensors file (faster than faulting in the map)."""
        handle = self._handles.get(self._key_file[key])
        return handle.read_bytes(key) if isinstance(handle, MappedSafetensors) else None

    def stored_dtype(self) -> str:
        return str(self.embedding().dtype).replace("torch.", "")


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


class MappedSafetensors:
    """A .safetensors file as zero-copy tensors over a private (copy-on-write) memory map.

    Format: 8-byte little-endian header length, a JSON header {key: {dtype, shape,
    data_offsets: [begin, end]}}, then the raw little-endian bytes.
    """

    def __init__(self, file: Path) -> None:
        self._path, self._file = file, open_regular(file, refuse_in(file))
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_COPY)
        (n,) = struct.unpack("<Q", self._map[:8])
        if n > len(self._map) - 8:
            raise ValueError(f"header length {n} exceeds the file size")
        header = json.loads(self._map[8:8 + n].decode("utf-8"))
        header.pop("__metadata__", None)
        _check_overlaps(header)
        self._base, self._header = 8 + n, header

    def keys(self) -> list[str]:
        return list(self._header)

    def read_bytes(self, key: str, block: int = 1 << 23) -> Iterator[bytes]:
        """The raw bytes of one tensor, read from the file in blocks."""
        begin, end = self._header[key]["data_offsets"]
        with open_regular(self._path, refuse_in(self._path)) as f:
            f.seek(self._base + begin)
            remaining = end - begin
            while remaining > 0:
                chunk = f.read(min(block, remaining))
                if not chunk:
                    raise ValueError(f"file ends inside tensor {key!r}")
                remaining -= len(chunk)
                yield chunk

    def meta(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) from the header; the byte range must fit the file and the shape."""
        info = self._header[key]
        if not isinstance(info, dict) or info.get("dtype") not in _SAFETENSORS_DTYPES:
            raise ValueError(f"unknown dtype {info.get('dtype') if isinstance(info, dict) else info!r}")
        shape, (begin, end) = tuple(int(n) for n in info["shape"]), info["data_offsets"]
        dtype = _SAFETENSORS_DTYPES[info["dtype"]]
        if not (0 <= begin <= end <= len(self._map) - self._base) or \
                end - begin != math.prod(shape) * torch.empty((), dtype=dtype).element_size():
            raise ValueError(f"data_offsets {[begin, end]} do not fit the file or the shape {list(shape)}")
        return shape, dtype

    def drop_pages(self) -> None:
        """Drop the resident pages (read again when touched: the map is private, never written)."""
        if hasattr(mmap, "MADV_DONTNEED"):
            self._map.madvise(mmap.MADV_DONTNEED)

    def get_tensor(self, key: str) -> torch.Tensor:
        info = self._header[key]
        dtype = _SAFETENSORS_DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        count = (end - begin) // torch.empty((), dtype=dtype).element_size()
        if count == 0:
            return torch.empty(info["shape"], dtype=dtype)
        flat = torch.frombuffer(self._map, dtype=dtype, count=count, offset=self._base + begin)
        return flat.reshape(info["shape"])


def _check_overlaps(header: dict) -> None:
    """No two tensors' byte ranges overlap (safetensors requires it; each would read the other's bytes)."""
    spans = sorted((r[0], r[1], k) for k, info in header.items() if isinstance(info, dict)
                   and isinstance(r := info.get("data_offsets"), list) and len(r) == 2
                   and all(type(v) is int for v in r) and r[0] < r[1])
    for (b0, e0, k0), (b1, e1, k1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise ValueError(f"tensors {k0!r} (data_offsets [{b0}, {e0}]) and {k1!r} ([{b1}, {e1}]) overlap; each "
                             f"tensor must have bytes of its own")


def _open_weights(file: Path):
    if file.suffix == ".safetensors":
        return MappedSafetensors(file)
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # legacy (non-zip) serialization cannot be memory-mapped
        return torch.load(file, map_location="cpu", weights_only=True)


def _weight_index(path: Path) -> tuple[dict[str, Path], dict[Path, object]]:
    """(tensor key -> file, already opened files), from whichever weight layout the directory has."""
    for name in _WEIGHT_FILES:
        f = path / name
        if not is_regular(f, refuse_in(f)):
            continue
        if name.endswith(".index.json"):
            try:
                weight_map = json.loads(read_regular(f, 1 << 30, refuse_in(f)).decode("utf-8"))["weight_map"]
            except (ValueError, KeyError, TypeError, RecursionError) as e:  # JSON, UTF-8, over-long ints
                raise ModelDirError(f"{f}: not a valid weight index ({e}); it needs a 'weight_map' table") from None
            if not isinstance(weight_map, dict) or not weight_map:
                raise ModelDirError(f"{f}: 'weight_map' must be a non-empty table of tensor name -> shard file")
            for key, shard in weight_map.items():
                if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
                    raise ModelDirError(f"{f}: tensor {key!r} maps to {shard!r}; shard entries must be file names "
                                        f"inside {path} (e.g. model-00001-of-00002.safetensors)")
                if not is_regular(path / shard, refuse_in(path / shard)):
                    raise ModelDirError(f"{f}: shard {shard} (tensor {key!r}) is missing from {path}")
            return {k: path / v for k, v in weight_map.items()}, {}
        try:
            handle = _open_weights(f)
            keys = list(handle.keys())
        except Exception as e:  # corrupted or truncated weight file
            raise ModelDirError(f"{f}: cannot read weights ({type(e).__name__}: {e})") from None
        return {k: f for k in keys}, {f: handle}
    raise ModelDirError(f"{path}: no weight file found; {MODEL_DIR_CONTENTS}")


def _dt_rank(table: dict, key: str, d_model: int, prefix: str = "") -> int:
    rank = table.get(key, "auto")
    return math.ceil(d_model / 16) if rank == "auto" else config_int(table, key, prefix=prefix)


def _dims_from_config(path: Path, cfg: dict, embed: torch.Tensor) -> tuple[str, ModelDims]:
    """(layout, dims) of a Mamba-1 config.json; a value of the wrong type is a ConfigValueError naming its key."""
    vocab, d_from_embed = embed.shape
    if "hidden_size" in cfg and "num_hidden_layers" in cfg:
        if cfg.get("use_bias"):
            raise ModelDirError(f"{path}: use_bias=true (biased in_proj/out_proj) is not supported by Quamba's W8A8 kernels")
        d_model = config_int(cfg, "hidden_size")
        d_inner = config_int(cfg, "intermediate_size", 0) or config_int(cfg, "expand", 2) * d_model
        return "transformers", ModelDims(
            d_model=d_model, d_inner=d_inner, d_state=config_int(cfg, "state_size", 16),
            d_conv=config_int(cfg, "conv_kernel", 4), dt_rank=_dt_rank(cfg, "time_step_rank", d_model),
            n_layer=config_int(cfg, "num_hidden_layers"), vocab_size=int(vocab),
            norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)))
    if "d_model" in cfg and "n_layer" in cfg:
        ssm = config_table(cfg, "ssm_cfg")
        if ssm.get("layer", "Mamba1") != "Mamba1":
            raise ModelDirError(f"{path}: ssm_cfg.layer={ssm['layer']!r}; only Mamba1 blocks are supported")
        if not cfg.get("rms_norm", True):
            raise ModelDirError(f"{path}: rms_norm=false (LayerNorm blocks) is not supported; Quamba uses RMSNorm")
        d_model, s = config_int(cfg, "d_model"), "ssm_cfg."
        return "mamba_ssm", ModelDims(
            d_model=d_model, d_inner=config_int(ssm, "expand", 2, prefix=s) * d_model,
            d_state=config_int(ssm, "d_state", 16, prefix=s), d_conv=config_int(ssm, "d_conv", 4, prefix=s),
            dt_rank=_dt_rank(ssm, "dt_rank", d_model, s), n_layer=config_int(cfg, "n_layer"), vocab_size=int(vocab),
            norm_eps=float(cfg.get("norm_epsilon", 1e-5)))
    raise ModelDirError(f"{path}/config.json has neither transformers keys (hidden_size, num_hidden_layers) "
                        f"nor mamba_ssm keys (d_model, n_layer); {MODEL_DIR_CONTENTS}")


def check_dims(path: Path, d: ModelDims) -> None:
    sizes = {"d_model": d.d_model, "d_inner": d.d_inner, "d_state": d.d_state, "d_conv": d.d_conv,
             "dt_rank": d.dt_rank, "n_layer": d.n_layer, "vocab_size": d.vocab_size}
    bad = [f"{k}={v}" for k, v in sizes.items() if not 0 < v <= 1 << 20]
    if bad:
        raise ModelDirError(f"{path}/config.json: sizes must be positive integers up to 2^20, got {', '.join(bad)}")
    if not (math.isfinite(d.norm_eps) and 0.0 < d.norm_eps < 1.0):
        raise ModelDirError(f"{path}/config.json: the norm epsilon must be a finite number in (0, 1), "
                            f"got {d.norm_eps}")


def _check_shapes(ckpt: Checkpoint) -> None:
    """Every tensor of every block (read from the headers, no data) against the sizes config.json implies."""
    d = ckpt.dims
    expected = {
        "in_proj": (2 * d.d_inner, d.d_model), "x_proj": (d.dt_rank + 2 * d.d_state, d.d_inner),
        "dt_proj": (d.d_inner, d.dt_rank), "dt_bias": (d.d_inner,), "A_log": (d.d_inner, d.d_state), "D": (d.d_inner,),
        "out_proj": (d.d_model, d.d_inner), "norm_weight": (d.d_model,), "conv_bias": (d.d_inner,),
    }
    conv = {(d.d_inner, 1, d.d_conv), (d.d_inner, d.d_conv)}
    for layer in range(d.n_layer):
        for name in LAYER_TENSORS:
            key = ckpt.layer_key(layer, name)
            if not ckpt.has(key):
                if name in _OPTIONAL:
                    continue
                raise ModelDirError(f"{ckpt.path}: tensor {key!r} is missing; config.json says the model has "
                                    f"{d.n_layer} blocks ({MODEL_DIR_CONTENTS})")
            got, dtype = ckpt.meta(key)
            if not dtype.is_floating_point:
                raise ModelDirError(f"{ckpt.path}: {key} has dtype {dtype}; weights must be floating point")
            if (got not in conv) if name == "conv_weight" else (got != expected[name]):
                want = f"{[d.d_inner, 1, d.d_conv]}" if name == "conv_weight" else f"{list(expected[name])}"
                raise ModelDirError(f"{ckpt.path}: {key} has shape {list(got)}, but config.json implies {want}")
    if ckpt.embedding().shape[1] != d.d_model:
        raise ModelDirError(f"{ckpt.path}: embedding width {ckpt.embedding().shape[1]} != d_model {d.d_model}")
    if not ckpt.embedding().dtype.is_floating_point:
        raise ModelDirError(f"{ckpt.path}: the embedding has dtype {ckpt.embedding().dtype}; it must be floating point")


def open_checkpoint(path: Path | str) -> Checkpoint:
    """Validate a model directory and index its tensors (reads config, the embedding and layer 0 shapes)."""
    path = Path(path)
    if not path.is_dir():
        raise ModelDirError(f"model directory {path} does not exist; {MODEL_DIR_CONTENTS}")
    cfg_file = path / "config.json"
    if not is_regular(cfg_file, refuse_in(cfg_file)):
        raise ModelDirError(f"{path}: config.json is missing; {MODEL_DIR_CONTENTS}")
    try:
        cfg = json.loads(read_regular(cfg_file, 1 << 20, refuse_in(cfg_file)).decode("utf-8"), parse_int=parse_int)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ModelDirError(f"{cfg_file} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ModelDirError(f"{cfg_file} must hold a JSON object")
    try:
        check_config_tables(cfg)
    except ConfigValueError as e:
        raise ModelDirError(f"{cfg_file}: {e}") from None
    key_file, handles = _weight_index(path)
    embed_key = next((k for k in _EMBED_KEYS if k in key_file), None)
    if embed_key is None:
        raise ModelDirError(f"{path}: no embedding tensor (backbone.embeddings.weight or backbone.embedding.weight); "
                            f"is this a Mamba checkpoint? {MODEL_DIR_CONTENTS}")
    ckpt = Checkpoint(path, key_file, embed_key, handles)
    for name in architecture_names():  # an architecture with a layout of its own (Mamba-2): its tensors, dims, checks
        opener = get_architecture(name).open_config
        if opener is not None and opener(ckpt, cfg, ModelDirError):
            return ckpt
    try:
        ckpt.format, ckpt.dims = _dims_from_config(path, cfg, ckpt.embedding())
    except ModelDirError:
        raise
    except ConfigValueError as e:
        raise ModelDirError(f"{cfg_file}: {e}") from None
    except (TypeError, ValueError, AttributeError, OverflowError) as e:
        raise ModelDirError(f"{cfg_file}: malformed value ({e})") from None
    check_dims(path, ckpt.dims)
    _check_shapes(ckpt)
    return ckpt
