"""Every Python block of README.md and docs/*.md runs as written.

Each page's blocks run in the runs their markers name (:mod:`tests.docs.markdown`), on
the page's stand-ins (:mod:`tests.docs.standins`): TorchRec's ``TestSparseNN``, and for
the migration page the app's DLRM too (the stock DCP recipes on TorchRec's model and on
ours). A block that cannot run says why in its marker.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.docs import standins
from tests.docs.markdown import PAGES, all_blocks, blocks
from tests.docs.runner import execute, runs

KINDS = {"docs/migration.md": ("testsparsenn", "dlrm")}
"""Pages run on more models than TorchRec's ``TestSparseNN``."""
CASES = [
    (page, kind)
    for page in PAGES
    if runs(blocks(page))
    for kind in KINDS.get(page, ("testsparsenn",))
]


@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("page, kind", CASES, ids=[f"{p}-{k}" for p, k in CASES])
def test_the_pages_python_runs_as_written(
    page: str, kind: str, docs_fixtures: Path, docs_env: dict[str, str], tmp_path: Path
) -> None:
    shutil.copytree(docs_fixtures / kind / "ckpt", tmp_path / "ckpt")
    env = standins.Env(tmp=str(tmp_path), kind=kind, fixtures=str(docs_fixtures))
    for run in runs(blocks(page)):
        execute(run, env, tmp_path, docs_env)


def test_every_python_block_runs_or_says_why_it_does_not() -> None:
    python = [b for b in all_blocks() if b.is_python]
    assert len(python) >= 17
    for block in python:
        assert block.skip or (block.run and standins.has_standin(block.page, block.run)), (
            f"{block.where}: no stand-in for run {block.run!r}, and no skip: marker"
        )
