"""``python -m benchmarks.serving_gpu``: see the package docstring."""

import sys

from benchmarks.serving_gpu.cli import main

main(sys.argv[1:])
