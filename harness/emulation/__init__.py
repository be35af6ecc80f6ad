"""The numeric core: the W8A8 kernels as pure-PyTorch ops (ops/), the emulated Mamba block and its
modules (modules), calibration observers, the recipe interpreter (build), weight preparation as
Quamba does it (weights) and the names of the capture points (capture). Imports spec and modes only.
"""
