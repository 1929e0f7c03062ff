"""The one result format of every benchmark and experiment, and how targets are judged.

A run writes one JSON file: ``format_version`` (1), ``case``, ``kind``, ``title``, ``date``,
``command``, ``note``, ``smoke``, ``environment``, ``config`` (every argument), ``wall_s``,
``measurements``, ``tables`` (:class:`Table`) and ``targets``: ``measured op factor *
reference``, judged by :meth:`Goal.evaluate` alone.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

FORMAT_VERSION = 1
PART = re.compile(r"\[([^\]]*)\]|([^.\[\]]+)")  # a name, or one with dots in brackets


def lookup(tree: Any, key: str, missing: Any = None) -> Any:
    """The value at a dotted ``key`` (list items by index), or ``missing`` if there is none."""
    node = tree
    for quoted, plain in PART.findall(key):
        part = quoted or plain
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return missing
    return node


def _ends(value: Any) -> list[float] | None:
    """A measured value as the numbers to judge: one, or both ends of a ``[low, high]`` range."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return [float(value)]
    pair = isinstance(value, list) and len(value) == 2
    if pair and all(isinstance(v, int | float) for v in value):
        return [float(v) for v in value]
    return None


@dataclass(frozen=True)
class Goal:
    """A bound that a measurement must meet: ``measured op factor * reference``, e.g.
    ``Goal("stall <= 1/10 of async_take's", "cnr.x.stall_s", "<=", "peers.y.stall_s", 0.1)``."""

    name: str
    """What it checks, in words."""
    measured_key: str
    """Dotted key of the measured value in ``measurements``."""
    op: Literal["<=", ">="]
    reference: str | float
    """Dotted key of the reference in ``measurements``, or a fixed value."""
    factor: float = 1.0
    """The bound is ``factor`` times the reference."""

    def __post_init__(self) -> None:
        if self.op not in ("<=", ">="):
            raise ValueError(f"op must be '<=' or '>=', got {self.op!r}")

    def evaluate(self, measurements: dict[str, Any]) -> dict[str, Any]:
        """The target with its measured value, reference, bound and verdict: ``PASS``, ``MISS``,
        ``MIXED`` (a range passes at one end only) or ``n/a`` (a value is ``None``).

        Raises:
            KeyError: a key the target names was not measured (a benchmark's mistake)."""
        measured = self._value(measurements, self.measured_key)
        reference = self.reference
        if isinstance(reference, str):
            reference = self._value(measurements, reference)
        ends, refs = _ends(measured), _ends(reference)
        verdict, bound = "n/a", None
        if ends is not None and refs is not None and len(refs) == 1:
            bound = self.factor * refs[0]
            passed = [v <= bound if self.op == "<=" else v >= bound for v in ends]
            verdict = "PASS" if all(passed) else "MISS" if not any(passed) else "MIXED"
        return {**asdict(self), "measured": measured, "reference_value": reference,
                "bound": bound, "verdict": verdict}  # fmt: skip

    def _value(self, measurements: dict[str, Any], key: str) -> Any:
        found = lookup(measurements, key, missing=KeyError)
        if found is KeyError:
            raise KeyError(f"target {self.name!r} names {key!r}, which was not measured")
        return found


Column = str | Callable[[dict[str, Any]], Any]
"""A table column: the key of a row's value, or a function of the row."""


@dataclass(frozen=True)
class Table:
    """A table of a result, rendered as markdown by :mod:`benchmarks.report`."""

    title: str
    columns: list[str]
    rows: list[list[Any]]
    """Cells: numbers (the report formats them) or text."""
    note: str = ""
    """A line under the table."""

    @classmethod
    def of(cls, title: str, items: Iterable[dict[str, Any]], columns: dict[str, Column],
           note: str = "") -> Table:  # fmt: skip
        """A table of ``items``, one row each; ``columns`` maps a header to its cells."""
        rows = [[c(i) if callable(c) else i.get(c) for c in columns.values()] for i in items]
        return cls(title, list(columns), rows, note)


def write(path: Path, record: dict[str, Any]) -> None:
    """A result record as JSON, ``targets`` evaluated and ``tables`` as plain lists."""
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"format_version": FORMAT_VERSION, **record,
              "tables": [asdict(t) for t in record["tables"]],
              "targets": [t.evaluate(record["measurements"]) for t in record["targets"]]}  # fmt: skip
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")


def load(path: Path) -> dict[str, Any]:
    """A result file; ``ValueError`` if it is not of this format version."""
    raw = json.loads(path.read_text())
    if raw.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {raw.get('format_version')!r}, not 1")
    return dict(raw)
