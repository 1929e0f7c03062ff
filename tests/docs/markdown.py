"""The code blocks of README.md and docs/*.md, and the markers the docs tests read.

A fenced block is one of:

- a **Python block** (```` ```python ````): run by ``tests/docs/test_python_blocks.py``;
- a **command block**: a plain fence whose first line starts with a command a user types
  (``cnr``, ``torchrun``, ``make``, ``bash``, ...): each command in it is run by
  ``tests/docs/test_commands.py``;
- anything else (a transcript, a tree, a table of output): not code, not run.

An HTML comment on the line just above a fence tells the tests how to run it:

- ``<!-- docs-test: run=NAME -->``: a Python block of the run ``NAME``. The blocks of one
  run execute in one process, in page order, after the page's stand-in ``NAME``
  (``tests/docs/standins.py``) has defined the names the page leaves to the reader;
  ``torchrun=N`` on any of them runs the whole run under ``torchrun`` on N ranks,
  ``ranks=N`` on N ranks of the tests' pool (see :mod:`tests.docs.runner`).
- ``<!-- docs-test: skip: WHY -->``: the block is not run, for the reason given.
- ``<!-- docs-test: skip K: WHY -->``: command K (from 1) of a command block is not run.

Every Python block must say how it runs, or why it does not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from tests import REPO

PAGES = ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))]
GENERATED = {"docs/benchmarks.md", "docs/experiments.md"}
"""Pages rendered from benchmark results: their commands are the benchmarks', which
``tests/e2e/test_benchmarks_smoke.py`` runs with ``--smoke``."""
COMMANDS = ("cnr ", "cnr-train ", "torchrun ", "make ", "bash ", "python ", ".venv/bin/")

FENCE = re.compile(r"^```(\w*)\n(.*?)^```\s*$", re.DOTALL | re.MULTILINE)
MARKER = re.compile(r"<!-- docs-test: (.*?) -->\s*$")


@dataclass
class Block:
    page: str
    line: int
    """Line of the opening fence (from 1)."""
    lang: str
    code: str
    marker: str | None
    run: str | None = None
    torchrun: int | None = None
    ranks: int | None = None
    skip: str | None = None
    skip_commands: dict[int, str] = field(default_factory=dict)
    """Command number (from 1) -> why it is not run."""

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def is_python(self) -> bool:
        return self.lang == "python"

    @property
    def is_commands(self) -> bool:
        first = next((ln for ln in self.code.splitlines() if ln.strip()), "")
        return self.lang in ("", "bash", "sh", "shell") and first.startswith(COMMANDS)

    def commands(self) -> list[str]:
        """Each command of a command block: continuation lines joined, comments dropped."""
        out: list[str] = []
        pending = ""
        for line in self.code.splitlines():
            line = _strip_comment(line).rstrip()
            if not line and not pending:
                continue
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            out.append(" ".join((pending + line).split()))
            pending = ""
        return out


def _strip_comment(line: str) -> str:
    """``line`` without a trailing ``# comment`` (a ``#`` outside quotes, after a space)."""
    quote = None
    for i, ch in enumerate(line):
        if ch in "'\"" and quote in (None, ch):
            quote = None if quote else ch
        elif ch == "#" and quote is None and (i == 0 or line[i - 1] == " "):
            return line[:i]
    return line


def _parse_marker(block: Block, text: str) -> None:
    if m := re.fullmatch(r"skip(?: (\d+))?: (.+)", text):
        if m.group(1):
            block.skip_commands[int(m.group(1))] = m.group(2)
        else:
            block.skip = m.group(2)
        return
    for part in text.split():
        key, _, value = part.partition("=")
        if key == "run" and value:
            block.run = value
        elif key in ("torchrun", "ranks") and value.isdigit():
            setattr(block, key, int(value))
        else:
            raise ValueError(f"{block.where}: unknown docs-test marker {text!r}")


def blocks(page: str) -> list[Block]:
    """Every fenced block of ``page`` (a path from the repository's root), in order."""
    text = (REPO / page).read_text()
    found = []
    for m in FENCE.finditer(text):
        markers: list[str] = []  # one comment each, stacked right above the fence
        for above in reversed(text[: m.start()].rstrip("\n").split("\n")):
            marker = MARKER.search(above)
            if marker is None:
                break
            markers.insert(0, marker.group(1))
        line = text.count("\n", 0, m.start()) + 1
        block = Block(page, line, m.group(1), m.group(2), "; ".join(markers) or None)
        for marker_text in markers:
            _parse_marker(block, marker_text)
        found.append(block)
    return found


def all_blocks() -> list[Block]:
    """Every fenced block of every page."""
    return [b for page in PAGES for b in blocks(page)]
