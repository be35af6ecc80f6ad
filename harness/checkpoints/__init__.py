"""What the harness reads from disk besides captures: transformers and mamba_ssm checkpoints
(loading), Quamba W8A8 checkpoints in and out (quamba), and text samples (text).
"""
