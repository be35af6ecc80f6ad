"""What the report reads from a capture file: everything through ``harness.store.format``, nothing else.

Works on any saved run (every schema the storage layer reads, ``--stats-only``
files included) and on the research tool's files (arrays only, no manifest).
Unknown keys are ignored. Sections of the stats file the report draws when present
(written by later harness versions; documented in docs/report.md):

    stats["end_to_end"] = {MODE: {"kl": x, "top1_agreement": x, "cross_entropy": x, "perplexity": x}}
        every value a number, or {"mean": x, "ci95": [lo, hi]} when several samples ran;
    stats["samples"] = {"count": N,
        "metrics": {MODE: {TENSOR: {METRIC: {"mean": x, "ci95": [lo, hi], "per_sample": [...]}}}},
        "pairs": [{"a": MODE, "b": MODE, "tensor": T, "metric": M, "mean_diff": x, "ci95": [lo, hi]}]}
    stats["sensitivity"] = {MODE: {LAYER: {"kl": x, "kl_share": x}}}    LAYER a block index as a string

Arrays ``mode_{m}__L{i}.block.isolated`` (the layer run on the reference's input)
are compared against the reference's ``L{i}.block.out``.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..metrics.compare import CompareError, compare_modes, same_basis
from ..metrics.errors import sqnr_db
from ..metrics.ranking import ORDER_TEXT, rank_layers
from ..store.reader import CaptureFile, load_capture

__all__ = ["ReportData", "load_report_data", "layer_and_site", "block_out_name", "as_float", "measured_float"]

_LAYER0 = {"input": "block.in", "output": "block.out", "residual": "block.residual"}
_POINT_RE = re.compile(r"^L(\d+)\.(.+)$")
BLOCK_SITES = ("block.in", "block.out", "block.residual", "block.isolated")


def layer_and_site(tensor: str) -> tuple[int | None, str]:
    """'output' -> (0, 'block.out'); 'L3.ssm.u' -> (3, 'ssm.u'); anything else -> (None, tensor)."""
    if tensor in _LAYER0:
        return 0, _LAYER0[tensor]
    m = _POINT_RE.match(tensor)
    return (int(m.group(1)), m.group(2)) if m else (None, tensor)


def block_out_name(layer: int) -> str:
    return "output" if layer == 0 else f"L{layer}.block.out"


def as_float(value) -> float | None:
    """A JSON number (1e999 is inf, schema 3) or, as schema 1-2 wrote them, the strings "inf", "-inf", "nan"."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def measured_float(value) -> float | None:
    """A metric's number: as_float of it, or of its mean where the stats hold a measured value ({"mean", "ci95"}:
    --samples)."""
    return as_float(value.get("mean")) if isinstance(value, dict) else as_float(value)


def _restore_floats(obj):
    if isinstance(obj, dict):
        return {k: _restore_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_restore_floats(v) for v in obj]
    return float(obj) if obj in ("inf", "-inf", "nan") else obj


@dataclass
class ReportData:
    path: Path
    capture: CaptureFile
    stats: dict                      # the manifest ({} for research-tool files)
    reference: str
    modes: list[str]                 # modes with arrays or stats, in the run's order
    comparison: dict | None          # the comparator's dict against `reference`
    failed: dict[str, str] = field(default_factory=dict)   # mode -> why

    @property
    def research_file(self) -> bool:
        return not self.stats

    def has_arrays(self) -> bool:
        return bool(self.capture.index)

    def tensors(self) -> list[str]:
        """Tensor names in capture order: the reference's first, then any only other modes have."""
        names = dict.fromkeys(self.capture.tensors(self.reference))   # a dict: linear in modes x tensors
        for mode in self.modes:
            names.update(dict.fromkeys(self.capture.tensors(mode)))
        if not names and self.comparison:
            for rows in self.comparison["modes"].values():
                names.update(dict.fromkeys(rows))
        return list(names)

    def array(self, mode: str, tensor: str) -> np.ndarray | None:
        if tensor not in self.capture.index.get(mode, {}):
            return None
        return np.asarray(self.capture.array(mode, tensor))

    def tensor_meta(self, mode: str, tensor: str) -> dict:
        entry = self.stats.get("modes", {}).get(mode, {})
        return entry.get("tensors", {}).get(tensor, {}) if isinstance(entry, dict) else {}

    def grid(self, mode: str, tensor: str) -> dict | None:
        """{"scale", "saturated_fraction", "clipped_fraction"} of an int8 tensor (with "scales", the summary of one
        scale per channel, and "scale" None for Quamba2's multi-scale taps), None for a float one."""
        meta = self.tensor_meta(mode, tensor)
        scale, scales = as_float(meta.get("scale")), meta.get("scales")
        if not meta.get("quantized") or not (scale or isinstance(scales, dict)):
            return None
        grid = {"scale": scale, "saturated_fraction": as_float(meta.get("saturated_fraction")),
                "clipped_fraction": as_float(meta.get("clipped_fraction"))}
        return {**grid, "scales": scales} if isinstance(scales, dict) else grid

    def mode_entry(self, mode: str) -> dict:
        entry = self.stats.get("modes", {}).get(mode, {})
        return entry if isinstance(entry, dict) else {}

    def layers(self) -> list[int]:
        found = {layer_and_site(t)[0] for t in self.tensors()}
        return sorted(x for x in found if x is not None)

    def taps_by_layer(self) -> dict[int, dict[str, dict[str, dict]]]:
        """layer -> tap -> mode -> grid, for the int8 tensors the stats describe."""
        out: dict[int, dict[str, dict[str, dict]]] = {}
        for mode in self.modes:
            for tensor in self.mode_entry(mode).get("tensors", {}):
                layer, site = layer_and_site(tensor)
                grid = self.grid(mode, tensor)
                if layer is not None and grid is not None:
                    out.setdefault(layer, {}).setdefault(site, {})[mode] = grid
        return dict(sorted(out.items()))

    def layer_sqnr(self) -> tuple[list[int], dict[str, list[float | None]], dict[str, list[float | None]]]:
        """(layers, accumulated, isolated): SQNR of each layer's block output per mode; isolated from
        L{i}.block.isolated against the reference's L{i}.block.out where the file has it."""
        layers = [i for i in self.layers() if self._row(self.reference, block_out_name(i)) is not None
                  or any(self._row(m, block_out_name(i)) for m in self.modes)]
        accumulated: dict[str, list] = {}
        isolated: dict[str, list] = {}
        for mode in self.modes:
            if mode == self.reference:
                continue
            acc = [as_float((self._row(mode, block_out_name(i)) or {}).get("sqnr_db")) for i in layers]
            iso = [self._isolated_sqnr(mode, i) for i in layers]
            if any(v is not None for v in acc):
                accumulated[mode] = acc
            if any(v is not None for v in iso):
                isolated[mode] = iso
        return layers, accumulated, isolated

    def layer_kinds(self) -> dict[int, str]:
        """Block -> its kind ("ssm", "attention", "mlp") for a hybrid model (spec.HybridDims.kinds); {} otherwise."""
        dims = (((self.stats.get("provenance") or {}).get("model") or {}).get("dims") or {})
        kinds = dims.get("kinds") if isinstance(dims, dict) else None
        return dict(enumerate(kinds)) if isinstance(kinds, list) else {}

    def kind_sqnr(self) -> dict[str, dict[str, dict]]:
        """mode -> kind -> the per-layer error grouped by layer kind: blocks, the worst isolated SQNR and its
        block, the mean isolated SQNR, the worst accumulated SQNR (the question: which kind breaks first)."""
        kinds = self.layer_kinds()
        layers, acc, iso = self.layer_sqnr()
        out: dict[str, dict[str, dict]] = {}
        for mode in dict.fromkeys([*acc, *iso]):
            by_kind: dict[str, dict] = {}
            for j, layer in enumerate(layers):
                kind = kinds.get(layer)
                if kind is None:
                    continue
                row = by_kind.setdefault(kind, {"blocks": [], "isolated": [], "accumulated": []})
                row["blocks"].append(layer)
                for key, values in (("isolated", iso.get(mode)), ("accumulated", acc.get(mode))):
                    if values is not None and values[j] is not None:
                        row[key].append((values[j], layer))
            out[mode] = {k: _kind_row(r) for k, r in by_kind.items()}
        return out

    def _row(self, mode: str, tensor: str) -> dict | None:
        return ((self.comparison or {}).get("modes", {}).get(mode) or {}).get(tensor)

    def _isolated_sqnr(self, mode: str, layer: int) -> float | None:
        row = self._row(mode, f"L{layer}.block.isolated")
        if row is not None:
            return as_float(row.get("sqnr_db"))
        test, ref = self.array(mode, f"L{layer}.block.isolated"), self.array(self.reference, block_out_name(layer))
        if test is None or ref is None or test.shape != ref.shape:
            return None
        return sqnr_db(ref, test)

    def sensitivity(self) -> dict[str, list[dict]]:
        """mode -> layers ranked from most to least harmful (metrics.ranking): by the KL of each layer alone
        where stats["sensitivity"] has it, else isolated SQNR, else accumulated SQNR."""
        layers, acc, iso = self.layer_sqnr()
        extra = self.stats.get("sensitivity") if isinstance(self.stats.get("sensitivity"), dict) else {}
        out = {}
        for mode in self.modes:
            if mode == self.reference or (mode not in acc and mode not in iso and mode not in extra):
                continue
            rows = []
            for k, layer in enumerate(layers):
                a = acc.get(mode, [None] * len(layers))[k]
                before = acc.get(mode, [None] * len(layers))[k - 1] if k else None
                kl = (extra.get(mode) or {}).get(str(layer)) or {}
                rows.append({"layer": layer, "isolated_sqnr_db": iso.get(mode, [None] * len(layers))[k],
                             "accumulated_sqnr_db": a,
                             "sqnr_drop_db": None if a is None or before is None or not math.isfinite(before) else before - a,
                             "kl": as_float(kl.get("kl")), "kl_share": as_float(kl.get("kl_share"))})
            out[mode] = rank_layers(rows)[1]
        return out

    @staticmethod
    def sensitivity_order(rows: list[dict]) -> str:
        """The heading's words for the order of ``sensitivity()``'s rows (metrics.ranking)."""
        key = rank_layers(rows)[0]
        return ORDER_TEXT[key] if key else "by layer"

    def end_to_end(self) -> dict[str, dict]:
        e2e = self.stats.get("end_to_end")
        if not isinstance(e2e, dict):
            return {}
        e2e = e2e.get("modes", e2e) if isinstance(e2e.get("modes"), dict) else e2e
        return {m: v for m, v in e2e.items() if isinstance(v, dict)}

    def samples(self) -> dict:
        s = self.stats.get("samples")
        return s if isinstance(s, dict) else {}


def _failed(stats: dict) -> dict[str, str]:
    out = {}
    for mode, entry in stats.get("modes", {}).items():
        if isinstance(entry, dict) and entry.get("status", "ok") != "ok":
            out[mode] = str(entry.get("error", "failed"))
    for mode in stats.get("failed_modes", []) or []:
        out.setdefault(str(mode), "failed")
    return out


def _reference(cf: CaptureFile, stats: dict, asked: str | None) -> str:
    if asked:
        return asked
    stored = (stats.get("comparison") or {}).get("reference")
    if stored:
        return stored
    modes = cf.modes()
    return "fp32" if "fp32" in modes or not modes else modes[0]


def load_report_data(path: Path, reference: str | None = None, require_reference: bool = True) -> ReportData:
    """Open a capture (our files or the research tool's) and gather what the report shows.

    Raises store.format.StorageError for unreadable files and, with require_reference, compare.CompareError
    for a reference the file lacks (without it, the report simply has no comparison).
    """
    cf = load_capture(Path(path))
    stats = _restore_floats(cf.manifest or {})
    ref = _reference(cf, stats, reference)
    modes = list(dict.fromkeys(list(stats.get("modes", {})) + cf.modes()))
    failed = _failed(stats)
    ok_modes = [m for m in modes if m not in failed]
    comparison = stats.get("comparison") if (stats.get("comparison") or {}).get("reference") == ref else None
    if comparison is None and not require_reference and ref not in cf.index:
        pass
    elif comparison is None and cf.index:
        tensors = {m: cf.tensors(m) for m in cf.modes()}
        comparable = same_basis(lambda m, t: cf.tensor_meta(m, t).get("basis"), ref) if cf.manifest else None
        comparison = compare_modes(tensors, cf.array, ref, comparable)
    elif comparison is None and ok_modes and ref not in ok_modes:
        raise CompareError(f"reference mode {ref!r} is not in the file; modes present: {', '.join(ok_modes)}; "
                           f"choose one with --reference {ok_modes[0]}")
    return ReportData(Path(path), cf, stats, ref, ok_modes, comparison, failed)


def _kind_row(r: dict) -> dict:
    iso, acc = r["isolated"], r["accumulated"]
    worst = min(iso) if iso else (None, None)
    return {"blocks": len(r["blocks"]), "isolated_min_db": worst[0], "isolated_min_layer": worst[1],
            "isolated_mean_db": sum(v for v, _ in iso) / len(iso) if iso else None,
            "accumulated_min_db": min(acc)[0] if acc else None}
