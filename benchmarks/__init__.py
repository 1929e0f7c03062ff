"""Benchmarks and experiments of torchrec_cnr, on one harness (:mod:`benchmarks.harness`).

Not shipped. A case runs as ``torchrun --standalone --nproc_per_node=N -m
benchmarks.<name> [options] --out FILE`` (or ``python -m`` where it runs in one process);
its ``--help`` says what it measures, and ``--smoke`` runs it at tiny sizes.
:data:`benchmarks.runs.RUNS` is the one list of runs, the command of every recorded result
(``benchmarks/results/``); ``python -m benchmarks.runs`` (``make bench``) runs them all.
"""
