#!/usr/bin/env python3
"""Compare every mode of a capture file against FP32 (or --reference MODE); see README for the formulas.

    python compare_with_fp.py first_layer_io_all_modes.npz --json comparison.json
"""
import sys

from harness.runtime.startup import begin, imported

begin()  # quiet Ctrl-C and SIGTERM during the imports, one BLAS thread for numpy

from harness.cli import compare_main  # noqa: E402

imported()

if __name__ == "__main__":
    sys.exit(compare_main(prog="compare_with_fp.py"))
