"""``python -m benchmarks.overhead``: see :mod:`benchmarks.overhead`."""

import sys

import benchmarks.overhead
from benchmarks.harness import main

sys.exit(main(benchmarks.overhead.CASE, benchmarks.overhead.__doc__))
