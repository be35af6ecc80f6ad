#!/usr/bin/env python3
"""Capture layer inputs/outputs of every mode into one .npz plus one _stats.json (see README).

    python save_first_layer_io.py --modes fp32 0 2-1 2-4 --seq_len 512
"""
import sys

from harness.runtime.startup import begin, imported

begin()  # quiet Ctrl-C and SIGTERM during the imports, one BLAS thread for numpy

from harness.cli import capture_main, preload  # noqa: E402

preload("capture")  # torch and the pipeline, while a signal still exits quietly
imported()

if __name__ == "__main__":
    sys.exit(capture_main(prog="save_first_layer_io.py"))
