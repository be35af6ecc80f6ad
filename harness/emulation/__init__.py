"""The emulated modules every architecture composes (modules: linear, norm, conv, scan, Hadamard, the Mamba-1
block, the backbone, each with its hook points), decode state, GPTQ of one linear, what every recipe's blocks
share (build) and the names of the capture points (capture). Imports spec, modes and kernels only.
"""
