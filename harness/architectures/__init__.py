"""Block architectures, one folder each (mamba1/, mamba2/), registered by name in registry.py: what a model's
blocks are, how their float weights are read and prepared, their capture sites and knob interpreter."""
