"""What the harness reads from disk besides captures: float checkpoints in the transformers and mamba_ssm
layouts (loading; an architecture with a layout of its own reads it through its open_config), tokenizers
(tokenizer) and text samples (text). Quantized checkpoints are their recipe family's (harness.recipes).
"""
