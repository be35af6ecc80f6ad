"""--resume: what the file being resumed already holds, and whether it is this run's file.

Resuming keeps every mode of the file (also those not asked for), adds the new
ones, and runs a kept mode again only when asked (--rerun), when it failed or its
recipe changed (and it is asked for), or when its arrays are incomplete (a tensor its stats list is missing, unreadable or of another shape).
A file made with another model, token ids, capture points, basis or calibration
is refused, as is a file whose .npz and stats do not belong together.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..modes import FORMAT_KNOBS, KNOBS, Q2_HEAD_KNOBS, Q2_KNOBS, ModeError, ModeRecipe
from ..store.format import StorageError, read_json, stats_path
from ..store.reader import load_capture

__all__ = ["ResumeError", "Kept", "previous_modes", "recorded_recipe", "kept_calibration"]


class ResumeError(ValueError):
    """The file given to --resume cannot be resumed by this run."""


@dataclass
class Kept:
    """A mode found in the file being resumed."""

    entry: dict
    arrays: dict[str, np.ndarray]   # tensor -> array
    complete: bool                  # every tensor its stats list is present, readable and of that shape
    missing: list[str]


def previous_modes(cfg, provenance: dict, calib_text) -> dict[str, Kept]:
    """Every mode of the file being resumed (in file order), with its arrays. Refuses another run's file."""
    out = Path(cfg.output_file)
    if not out.is_file():
        return {}
    cf = load_capture(out)  # checks that the .npz and its stats belong together
    old = cf.manifest
    if old is None:
        raise ResumeError(f"--resume: {out} has no stats file ({stats_path(out).name}), so what it holds cannot be "
                       f"checked; use another --output_file or drop --resume (which replaces the file)")
    if old.get("stats_only") or cfg.stats_only:
        raise ResumeError("--resume does not work with --stats-only files (they hold no arrays to keep); "
                          "use another --output_file or drop --resume")
    old_prov = old.get("provenance") if isinstance(old.get("provenance"), dict) else {}
    for what, new, was in (("model", provenance["model"]["hash"], (old_prov.get("model") or {}).get("hash")),
                           ("token ids", provenance["sample"]["token_ids_sha256"], (old_prov.get("sample") or {}).get("token_ids_sha256")),
                           ("capture points", provenance["points"], old_prov.get("points")),
                           ("basis", provenance["basis"], old_prov.get("basis"))):
        if new != was:
            raise ResumeError(f"--resume: {cfg.output_file} was made with a different {what}; "
                           f"use another --output_file or drop --resume")
    old_calib = old_prov.get("calibration") or {}
    if calib_text is not None and "settings" in old_calib and (
            old_calib["settings"] != asdict(cfg.calib) or old_calib.get("calib_file_sha256") != calib_text.sha256):
        raise ResumeError(f"--resume: {cfg.output_file} was calibrated with other settings or text; "
                       f"use another --output_file or drop --resume")
    kept = {}
    for mode, entry in old.get("modes", {}).items():
        arrays, missing = {}, []
        for tensor, meta in (entry.get("tensors") or {}).items():
            try:
                arr = np.array(cf.array(mode, tensor))
            except StorageError:
                missing.append(tensor)
                continue
            if isinstance(meta, dict) and list(arr.shape) != meta.get("shape"):
                missing.append(tensor)
                continue
            arrays[tensor] = arr
        complete = not missing and bool(arrays)
        kept[mode] = Kept(entry, arrays, complete, missing)
    return kept


def recorded_recipe(mode: str, entry: dict) -> ModeRecipe | None:
    """The recipe a file recorded for `mode` (to re-run a kept mode that was not asked for)."""
    knobs = entry.get("recipe")
    try:
        return ModeRecipe(name=mode, title=str(entry.get("title", "")), **{k: knobs[k] for k in KNOBS},
                          **{k: knobs[k] for k in (*FORMAT_KNOBS, "layers", *Q2_KNOBS, *Q2_HEAD_KNOBS) if k in knobs})
    except (ModeError, KeyError, TypeError):
        return None


def kept_calibration(cfg) -> dict[str, dict]:
    """prep -> the calibration provenance of the file being resumed (read after ``previous_modes`` checked the
    pair). A resumed run that calibrates nothing (every quantized mode kept) records these, so the kept modes'
    calibration stays on record and a later --resume with other settings is still refused."""
    stats = read_json(stats_path(Path(cfg.output_file)))
    prov = stats.get("provenance") if isinstance(stats.get("provenance"), dict) else {}
    by_prep = prov.get("calibration_by_prep") if isinstance(prov.get("calibration_by_prep"), dict) else {}
    if not by_prep and isinstance(prov.get("calibration"), dict):
        by_prep = {str(prov["calibration"].get("prep", "quamba")): prov["calibration"]}
    return {p: i for p, i in by_prep.items() if isinstance(i, dict)}

