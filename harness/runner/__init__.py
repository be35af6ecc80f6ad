"""A run, from command to pair; it asks the registries and names no recipe: pipeline orchestrates; modeloop
runs each mode; forwards runs a mode's blocks (backbone: built by the mode's family) with its hooks; studies
runs the analyses that run the model more than once; calibration (the shared types) and layercache (the one
per-layer cache), pairing (a quantized checkpoint with its float model), collect (comparison and storage as
modes finish), resume, checks, export (the command around a registered exporter), the weight bank and its
shared ops.
"""
