"""Benchmarks and experiments of torchrec_cnr, on one harness (:mod:`benchmarks.harness`).

Not shipped. A case runs as ``torchrun --standalone --nproc_per_node=N -m
benchmarks.<name> [options] --out FILE`` (those of :data:`SINGLE_PROCESS` by ``python
-m``); its ``--help`` says what it measures, and ``--smoke`` runs it at tiny sizes. The
Makefile's ``bench`` target is the one list of runs, the command of every recorded result
(``benchmarks/results/``); the names below are read from it.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

MAKEFILE = Path(__file__).resolve().parents[1] / "Makefile"


def bench_runs() -> list[list[str]]:
    """The commands of the Makefile's ``bench`` target, in order, variables expanded."""
    text = MAKEFILE.read_text()
    variables = dict(re.findall(r"^(\w+) *[:?]?= *(.*)$", text, re.MULTILINE))

    def expand(line: str) -> str:
        while "$(" in line:
            line = re.sub(r"\$\((\w+)\)", lambda m: variables[m.group(1)], line)
        return line

    target = re.search(r"^bench: .*?\n((?:\t.*\n)+)", text, re.MULTILINE)
    assert target is not None, "the Makefile has no bench target"
    return [shlex.split(expand(line.strip())) for line in target.group(1).splitlines()]


def _modules() -> dict[str, bool]:
    """Each module the bench target runs (less ``benchmarks.``) -> whether by ``python -m``."""
    found: dict[str, bool] = {}
    for argv in bench_runs():
        at = argv.index("-m")
        module = argv[at + 1].removeprefix("benchmarks.")
        if module != "report":
            alone = not any(a.endswith("torchrun") for a in argv[:at])
            found[module] = found.get(module, True) and alone
    return found


CASES = tuple(sorted(m for m in _modules() if not m.startswith("experiments.")))
"""The benchmarks: ``benchmarks.<name>``, results in ``out/bench/``."""
EXPERIMENTS = tuple(sorted(m.split(".", 1)[1] for m in _modules() if m.startswith("experiments.")))
"""The experiments: ``benchmarks.experiments.<name>``, in ``out/bench/experiments/``."""
SINGLE_PROCESS = tuple(sorted(m for m, alone in _modules().items() if alone))
"""Cases run by ``python -m`` in one process (serving, shards); the others by torchrun."""
