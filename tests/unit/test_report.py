"""The figures in README.md and docs/ are rendered from the recorded results, never typed:
the committed pages are what ``python -m benchmarks.report`` writes from
``benchmarks/results/``, and a placeholder that names no value fails. The report is run as
a command, as ``make bench`` runs it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from tests import REPO

TEMPLATES = REPO / "benchmarks" / "templates"


def _report(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "benchmarks.report", *args]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_committed_pages_are_rendered_from_the_recorded_results(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    shutil.copy(REPO / "README.md", readme)
    done = _report("--docs", str(tmp_path / "docs"), "--readme", str(readme))
    assert done.returncode == 0, done.stderr
    assert readme.read_text() == (REPO / "README.md").read_text(), (
        "run: python -m benchmarks.report"
    )
    templates = sorted(TEMPLATES.glob("*.md"))
    assert templates
    for template in templates:
        page = (REPO / "docs" / template.name).read_text()
        rendered = (tmp_path / "docs" / template.name).read_text()
        assert rendered == page, f"docs/{template.name} is stale"


def test_a_placeholder_renders_arithmetic_on_values_and_fails_on_a_missing_one(
    tmp_path: Path,
) -> None:
    results = tmp_path / "results"
    results.mkdir()
    r = {"format_version": 1, "smoke": False,
         "measurements": {"a": 3.0, "b": [1.0, 2.0], "c-d": {"e": 4}}}  # fmt: skip
    (results / "r.json").write_text(json.dumps(r))

    def render(text: str) -> subprocess.CompletedProcess[str]:
        (tmp_path / "page.md").write_text(text)
        return _report(str(results), "--render", str(tmp_path / "page.md"))

    text = "{{r:measurements.a * 2|.1f}} {{r:measurements.b|.0f}} {{max(r:measurements.a, r:measurements.c-d.e)}}"
    done = render(text)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "6.0 1-2 4"
    for text, message in [
        ("{{r:measurements.z}}", "has no 'measurements.z'"),
        ("{{q:measurements.a}}", "no result 'q'"),
        ("{{r:measurements.a ** 2}}", "not arithmetic"),
    ]:
        done = render(text)
        assert done.returncode != 0 and "ValueError" in done.stderr, (text, done.stderr)
        assert message in done.stderr, (text, done.stderr)
