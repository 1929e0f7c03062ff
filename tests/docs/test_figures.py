"""No measured figure is typed: the hand-written pages state what was measured in words and
link to the rendered pages, and the templates write each measured figure as a placeholder
that ``python -m benchmarks.report`` fills in from a result (``benchmarks/report.py``).

Pure text, no training: the hand-written pages (README.md outside its figures block, and
every page of ``docs/`` that is not rendered) may hold no number followed by a time, a
throughput or an ``x`` ratio (``12 ms``, ``0.6 GB/s``, ``~3x``); the templates may hold no
number followed by a time or a throughput outside their ``{{...}}`` placeholders (a ratio
there may be a paper's, such as Check-N-Run's 6-17x). Fenced code and HTML comments are left
out of both checks. Defaults and constants of the code are in other units (``64 MB``,
``600 s``) and are not matched.
"""

from __future__ import annotations

import re

import pytest

from tests.docs.markdown import GENERATED, PAGES, REPO

TEMPLATES = REPO / "benchmarks" / "templates"
"""What ``python -m benchmarks.report`` renders README's figures block and docs/ from."""
README_BLOCK = re.compile(r"<!-- figures: begin -->\n.*?<!-- figures: end -->", re.DOTALL)
"""README's figures block, rendered from ``templates/readme/figures.md``."""

HAND_WRITTEN = [page for page in PAGES if page not in GENERATED]

FENCE = re.compile(r"^```.*?^```[ \t]*$", re.DOTALL | re.MULTILINE)
COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
PLACEHOLDER = re.compile(r"\{\{.*?\}\}", re.DOTALL)

NUMBER = r"(?<![\w.])~?\d+(?:[.,]\d+)*"
TIME_OR_RATE = re.compile(NUMBER + r"\s?(?:ms|µs|us|ns|[KMG]i?B/s)(?![\w/])")
"""A number followed by a time under a second or a throughput: ``11.6 ms``, ``0.61 GB/s``
(``tens of MB/s`` has no number)."""
RATIO = re.compile(NUMBER + r"x(?!\w)")
"""A ratio or a speed-up: ``1.4x``, ``~3x``, ``4-13x``."""

ALLOWED: dict[tuple[str, str], str] = {}
"""(page, the matched text) -> why that figure is not a measurement. Empty: every
legitimate number on the pages is in another unit."""


def _blank(pattern: re.Pattern[str], text: str) -> str:
    """``text`` with each match of ``pattern`` replaced by as many newlines as it held, so
    that line numbers stay right."""
    return pattern.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def _prose(page: str) -> str:
    text = (REPO / page).read_text()
    if page == "README.md":
        assert README_BLOCK.search(text), "README.md lost its <!-- figures: ... --> block"
        text = _blank(README_BLOCK, text)
    return _blank(COMMENT, _blank(FENCE, text))


def _typed(text: str, patterns: list[re.Pattern[str]]) -> list[tuple[int, str]]:
    found = []
    for number, line in enumerate(text.split("\n"), start=1):
        for pattern in patterns:
            found += [(number, m.group(0)) for m in pattern.finditer(line)]
    return found


def test_the_hand_written_pages_are_the_expected_ones() -> None:
    assert "README.md" in HAND_WRITTEN and "docs/user-guide.md" in HAND_WRITTEN
    assert not set(HAND_WRITTEN) & GENERATED


@pytest.mark.parametrize("page", HAND_WRITTEN)
def test_a_hand_written_page_types_no_measured_figure(page: str) -> None:
    typed = [
        f"{page}:{line}: {figure!r}"
        for line, figure in _typed(_prose(page), [TIME_OR_RATE, RATIO])
        if (page, figure) not in ALLOWED
    ]
    assert not typed, (
        "measured figures typed in prose: say it in words and link to the rendered section "
        "of docs/benchmarks.md (or README's headline figures), or render it in a template "
        "of benchmarks/templates/:\n" + "\n".join(typed)
    )


@pytest.mark.parametrize(
    "template", sorted(str(p.relative_to(REPO)) for p in TEMPLATES.rglob("*.md")), ids=str
)
def test_a_template_types_no_time_or_throughput_outside_its_placeholders(template: str) -> None:
    text = _blank(PLACEHOLDER, (REPO / template).read_text())
    typed = [
        f"{template}:{line}: {figure!r}"
        for line, figure in _typed(_blank(COMMENT, _blank(FENCE, text)), [TIME_OR_RATE])
    ]
    assert not typed, (
        "a figure typed in a template: write it as {{RESULT:path|format}} (README.md's "
        "figures block and docs/*.md are rendered from these):\n" + "\n".join(typed)
    )


def test_the_checks_catch_what_they_are_for() -> None:
    prose = "\n".join(
        [
            "It took 11.6 ms, and 2.5 ms at 5%; a quantizer at 0.61 GB/s, moto at 40 MB/s.",
            "The export takes 1.4x as long, ~3x zlib's speed, 4-13x fewer bytes.",
            "Not these: 64 MB objects, a 600 s timeout, 8 bits, 2x2 tiles, `ms` alone, 0x1f.",
            "```",
            "stall 11.6 ms",
            "```",
            "<!-- 3.4 ms -->",
        ]
    )
    found = _typed(_blank(COMMENT, _blank(FENCE, prose)), [TIME_OR_RATE, RATIO])
    assert [f for _, f in found] == [
        "11.6 ms", "2.5 ms", "0.61 GB/s", "40 MB/s", "1.4x", "~3x", "13x",
    ]  # fmt: skip
    template = "took {{r:m.s * 1e3|.1f}} ms, not 12 ms"
    assert [f for _, f in _typed(_blank(PLACEHOLDER, template), [TIME_OR_RATE])] == ["12 ms"]


def test_only_the_readme_figures_block_is_left_out_of_the_readme() -> None:
    lines = (REPO / "README.md").read_text().split("\n")
    begin, end = lines.index("<!-- figures: begin -->"), lines.index("<!-- figures: end -->")
    prose = _prose("README.md").split("\n")
    assert len(prose) == len(lines)
    assert not any(prose[begin : end + 1]), "the figures block is left out"
    assert prose[: begin - 1] != [""] * (begin - 1) and "## Documentation" in prose[end + 1 :]
