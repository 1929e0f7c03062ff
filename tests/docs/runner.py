"""Runs the Python blocks of a documented page as a user's script runs them.

The blocks of one run (:mod:`tests.docs.markdown`) become one script: the page's
stand-ins first (:mod:`tests.docs.standins`), then each block as written (its ``/ckpt/``
paths mapped into the test's folder), then the stand-ins' check. The script runs

- under a real ``torchrun --standalone --nproc_per_node=N`` (marker ``torchrun=N``): the
  blocks that start the process group themselves, as a user's ``train.py`` does;
- on N ranks of the tests' rank pool (``ranks=N``), whose processes joined their group
  with the library's public launcher, as torchrun's workers do;
- otherwise in this process, without a process group.
"""

from __future__ import annotations

import os
import subprocess
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests import TORCHRUN
from tests.docs.markdown import REPO, Block
from tests.docs.standins import Env, localize


@dataclass
class Run:
    page: str
    name: str
    blocks: list[Block] = field(default_factory=list)

    @property
    def torchrun(self) -> int | None:
        return next((b.torchrun for b in self.blocks if b.torchrun), None)

    @property
    def ranks(self) -> int | None:
        return next((b.ranks for b in self.blocks if b.ranks), None)

    def script(self, env: Env) -> str:
        """The run as one Python script."""
        parts = [
            "import sys",
            f"sys.path.insert(0, {str(REPO)!r})",
            "from tests.docs import standins as _standins",
            f"_end = _standins.begin({self.page!r}, {self.name!r}, _standins.{env!r}, globals())",
        ]
        for block in self.blocks:
            parts += [f"# --- {block.where}", localize(block.code, env.tmp).rstrip()]
        parts.append("_end()")
        return "\n".join(parts) + "\n"


def runs(page_blocks: list[Block]) -> list[Run]:
    """The page's runs, in the order of their first block."""
    found: dict[str, Run] = {}
    for block in page_blocks:
        if block.is_python and block.skip is None:
            assert block.run, f"{block.where}: a Python block needs a run= or skip: marker"
            found.setdefault(block.run, Run(block.page, block.run)).blocks.append(block)
    return list(found.values())


def _exec(script: str) -> None:
    exec(compile(script, "<docs>", "exec"), {"__name__": "__docs__"})


def execute(run: Run, env: Env, folder: Path, environ: dict[str, str] | None = None) -> str:
    """Runs ``run``; returns its output (torchrun only). Raises on any failure."""
    script = run.script(env)
    path = folder / f"{Path(run.page).stem}-{run.name}.py"
    path.write_text(script)  # kept beside the test's files, to read after a failure
    if run.torchrun:
        cmd = [str(TORCHRUN), "--standalone", f"--nproc_per_node={run.torchrun}", str(path)]
        proc = subprocess.run(
            cmd, cwd=folder, env=environ or dict(os.environ), capture_output=True, text=True,
            timeout=280,
        )  # fmt: skip
        assert proc.returncode == 0, textwrap.shorten(proc.stdout, 2000) + proc.stderr[-4000:]
        return proc.stdout
    if run.ranks:
        from tests.multiprocess import run_ranks

        run_ranks(run.ranks, _exec, script)
        return ""
    _exec(script)
    return ""


def describe(run: Run) -> dict[str, Any]:
    return {"page": run.page, "run": run.name, "blocks": [b.where for b in run.blocks]}
