"""Benchmarks and experiments of torchrec_cnr, on one harness (:mod:`benchmarks.harness`).

Not shipped: the wheels hold ``torchrec_cnr`` and ``cnr_train`` only. Each module's
docstring gives its command; ``make bench`` runs them all at full size into ``out/bench/``
and renders ``docs/benchmarks.md`` and ``docs/experiments.md`` (:mod:`benchmarks.report`).
Every case takes ``--smoke``: tiny sizes, the same code path, seconds.
"""

CASES = (
    "checkpoint",
    "dcp_interop",
    "history",
    "offline",
    "overhead",
    "policies",
    "quantization",
    "scaling",
    "serving",
    "shards",
    "stall",
    "storage",
    "tracking",
)
"""The benchmarks: ``benchmarks.<name>``, results in ``out/bench/<name>.json``."""
EXPERIMENTS = ("cpr", "quantized_restores")
"""The experiments: ``benchmarks.experiments.<name>``, in ``out/bench/experiments/``."""
SINGLE_PROCESS = ("quantization", "serving", "shards")
"""Cases run by ``python -m`` in one process (serving starts its own job and serving
process, shards simulates its ranks); the others by torchrun on 2 ranks."""
