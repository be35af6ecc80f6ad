"""The checkpoint layouts of enyac-group/Quamba that a run reads (``QuambaLMHeadModel.save_pretrained`` of Quamba1's
W8A8, Quamba2's W8A8, W4A8 and W4A16 models), as one registered format: its reader tells them apart by config."""
from __future__ import annotations

from pathlib import Path

from ..registry import CheckpointFormat, register_checkpoint_format
from ...checkpoints.loading import ModelDirError
from .checkpoint import QUAMBA_MIXERS, SUPPORTED, QuambaCheckpoint, read_config, is_quamba_dir, open_quamba
from .pairing import check_pair
from .q2.checkpoint import is_quamba2_config, open_quamba2
from .q2.checkpoint_checks import SUPPORTED2
from .w4.checkpoint_mamba1 import is_mamba1_w4_config, open_quamba1_w4
from .w4.checkpoint_mamba2 import is_w4_config, open_quamba2_w4

__all__ = ["register_formats", "open_any_quamba", "QUAMBA_FORMAT"]


def open_any_quamba(path: Path | str) -> QuambaCheckpoint:
    """A Quamba checkpoint directory (is_quamba_dir): Quamba2's or Quamba1's reader by its config."""
    cfg = read_config(Path(path))
    if cfg is not None and is_quamba2_config(cfg):
        if is_w4_config(cfg):
            return open_quamba2_w4(path)
        return open_quamba2(path)
    if cfg is not None and is_mamba1_w4_config(cfg):  # Quamba2's W4A8QMamba / W4A16QMamba on Mamba-1
        return open_quamba1_w4(path)
    ssm = cfg.get("ssm_cfg") if cfg is not None and isinstance(cfg.get("ssm_cfg"), dict) else {}
    layer = ssm.get("layer", "W8A8QMamba")
    if isinstance(layer, str) and layer not in QUAMBA_MIXERS:  # quamba_mixer_seq.py:82-85
        raise ModelDirError(f"{path}: ssm_cfg.layer {layer!r} is not supported; supported: {SUPPORTED}; {SUPPORTED2}")
    return open_quamba(path)


QUAMBA_FORMAT = CheckpointFormat("quamba", is_quamba_dir, open_any_quamba, check_pair)


def register_formats() -> None:
    register_checkpoint_format(QUAMBA_FORMAT)
