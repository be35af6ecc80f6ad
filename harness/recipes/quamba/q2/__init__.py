"""Quamba2's W8A8 of Mamba-2 blocks: head/dim grouping, two-pass calibration, the int8 block, its checkpoints and
export, the quantized lm_head's scale."""
