"""Quamba2's W4A8 and W4A16: GPTQ of a model on CPU (both architectures), the Marlin blocks, their checkpoints
(with the W4 embedding and lm_head) and exports."""
