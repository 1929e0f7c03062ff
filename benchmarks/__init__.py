"""Benchmarks and experiments of torchrec_cnr, on one harness (:mod:`benchmarks.harness`).

Not shipped. ``torchrun --standalone --nproc_per_node=N -m benchmarks.<name> --out FILE``
(or ``python -m``) runs a case; ``--help`` says what it measures, ``--smoke`` runs it tiny.
:data:`benchmarks.runs.RUNS` holds the command of every recorded result.
"""
