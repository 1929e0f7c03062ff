"""Renders benchmark results (JSON, :mod:`benchmarks.results`) into markdown: per result,
its command, environment, tables and each target's measured value, bound and verdict.

    .venv/bin/python -m benchmarks.report                          # benchmarks/results/ only
    .venv/bin/python -m benchmarks.report benchmarks/results out/bench
    .venv/bin/python -m benchmarks.report out/bench --render PAGE.md   # to stdout only

A result's id is its file name without ``.json``, a later folder's replacing an earlier
one's. In ``benchmarks/templates/*.md`` (the pages written under ``--docs``) a line
``<!-- result: ID -->`` becomes result ``ID``'s section, ``{{ID:dotted.path}}`` a value (a
key with a dot in brackets: ``by_frac[0.25%].ratio``) and ``{{EXPR|SPEC}}`` arithmetic on
values (``+ - * /`` between spaces, numbers, parentheses, ``min``, ``max``), formatted, e.g.
``{{stall:measurements.cases.lazy_5.stall_s * 1e3|.1f}}``; a list of two is a range. A
placeholder that names no value fails. ``README.md``'s figures block is rendered from
``templates/readme/figures.md``. ``--smoke`` results are left out unless ``--allow-smoke``.
"""

from __future__ import annotations

import argparse
import ast
import operator
import re
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.results import load, lookup

TEMPLATES = Path(__file__).parent / "templates"
RECORDED = Path(__file__).parent / "results"
MARKER = re.compile(r"^<!-- result: ([\w.-]+) -->$", re.MULTILINE)
VALUE = re.compile(r"\{\{([^}|]+?)(?:\|([^}]*))?\}\}")
REF = re.compile(r"([A-Za-z_][\w-]*):((?:[\w\-]+|\[[^\]]*\])(?:\.?(?:[\w\-]+|\[[^\]]*\]))*)")
_MISSING = object()
README = Path(__file__).resolve().parents[1] / "README.md"
README_FIGURES = TEMPLATES / "readme" / "figures.md"
README_BLOCK = re.compile(r"(<!-- figures: begin -->\n).*?(<!-- figures: end -->)",
                          re.DOTALL | re.MULTILINE)  # fmt: skip


def fmt(x: Any) -> str:
    """A cell: numbers to four significant digits, ``[lo, hi]`` as a range."""
    if x is None or x == "":
        return "–" if x is None else ""
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if isinstance(x, float) and abs(x) >= 1000:
        return f"{x:,.0f}"
    if isinstance(x, float):  # four significant digits, no exponent down to 1e-4
        return f"{x:.4g}" if abs(x) >= 1e-4 or x == 0 else f"{x:.3e}"
    if isinstance(x, list) and len(x) == 2:
        return f"{fmt(x[0])}–{fmt(x[1])}"
    return str(x).replace("|", "\\|")


def _table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    numeric = [all(isinstance(r[i], int | float) for r in rows if r[i] != "")
               for i in range(len(columns))]  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |"]
    lines.append("|" + "|".join("---:" if n else "---" for n in numeric) + "|")
    lines += ["| " + " | ".join(fmt(c) for c in r) + " |" for r in rows]
    return lines


def _environment(env: dict[str, Any]) -> str:
    world = env.get("world_size")
    parts = [
        *([f"host `{env['host']}`"] if env.get("host") else []),
        *([f"{env['cpu_count']} CPU cores"] if env.get("cpu_count") else []),
        *([f"{env['memory_gib']} GiB"] if env.get("memory_gib") else []),
        env.get("gpu") or "no GPU",
        *([f"{world} ranks" if world > 1 else "1 process"] if world else []),
        *(f"{k} {v}" for k, v in env.get("versions", {}).items() if k != "python"),
        *(f"`{k}={v}`" for k, v in env.get("env", {}).items()),
        *([f"commit `{env['git']}`"] if env.get("git") else []),
        *([env["description"]] if env.get("description") else []),
    ]
    return "; ".join(parts)


def _targets(targets: list[dict[str, Any]]) -> list[str]:
    rows = []
    for t in targets:
        ref = t["reference"]
        ref_text = fmt(t["reference_value"]) + (f" (`{ref}`)" if isinstance(ref, str) else "")
        bound = "–" if t["bound"] is None else f"{t['op']} {fmt(t['bound'])}"
        if t["factor"] != 1 and t["bound"] is not None:
            bound += f" ({t['factor']:.3g} x reference)"
        verdict = t["verdict"] if t["verdict"] == "n/a" else f"**{t['verdict']}**"
        rows.append([t["name"], fmt(t["measured"]), ref_text, bound, verdict])
    passed = sum(t["verdict"] == "PASS" for t in targets)
    lines = [f"Targets: {passed} of {len(targets)} pass.", ""]
    return lines + _table(["target", "measured", "reference", "bound", "verdict"], rows)


def section(r: dict[str, Any]) -> str:
    """One result as markdown: command, environment, tables, targets."""
    lines = [f"Measured {r['date'][:10]} by:", "", "```", r["command"], "```", "",
             f"Environment: {_environment(r['environment'])}."]  # fmt: skip
    if r.get("note"):
        lines += ["", f"> {r['note']}"]
    for t in r["tables"]:
        lines += ["", f"**{t['title']}**", "", *_table(t["columns"], t["rows"])]
        if t.get("note"):
            lines += ["", t["note"]]
    if r["targets"]:
        lines += ["", *_targets(r["targets"])]
    return "\n".join(lines)


def collect(folders: Sequence[Path], allow_smoke: bool = False) -> dict[str, dict[str, Any]]:
    """Result id (file name) -> result; a later folder's result replaces an earlier one's."""
    found: dict[str, dict[str, Any]] = {}
    for folder in folders:
        for path in sorted(folder.rglob("*.json")):
            r = load(path)
            if r["smoke"] and not allow_smoke:
                print(f"skipping {path}: a --smoke run", file=sys.stderr)
                continue
            found[path.stem] = r
    return found


def value(results: dict[str, dict[str, Any]], rid: str, path: str) -> Any:
    """The value at dotted ``path`` of result ``rid``; ``ValueError`` if there is none."""
    if rid not in results:
        raise ValueError(f"no result {rid!r}: run its command, or pass its folder")
    node = lookup(results[rid], path, missing=_MISSING)
    if node is _MISSING:
        raise ValueError(f"result {rid!r} has no {path!r}")
    return node


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv}  # fmt: skip
_CALLS: dict[str, Any] = {"min": min, "max": max}


def _evaluate(node: ast.AST, refs: list[Any]) -> Any:
    """Arithmetic only: numbers, references ``_0``, ``_1``, ..., ``+ - * /``, ``min``, ``max``."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, refs)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.Name) and node.id.startswith("_") and node.id[1:].isdigit():
        return refs[int(node.id[1:])]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _CALLS:
        args = [_evaluate(a, refs) for a in node.args]
        return _CALLS[node.func.id](x for a in args for x in (a if isinstance(a, list) else [a]))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand, refs)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left, refs), _evaluate(node.right, refs)
        if isinstance(left, list) or isinstance(right, list):  # a range, scaled
            pair = [left, right]
            return [_OPS[type(node.op)](*(p[i] if isinstance(p, list) else p for p in pair))
                    for i in range(2)]  # fmt: skip
        return _OPS[type(node.op)](left, right)
    raise ValueError(f"not arithmetic on results: {ast.dump(node)}")


def _figure(results: dict[str, dict[str, Any]], m: re.Match[str]) -> str:
    expr, spec = m.group(1).strip(), m.group(2)
    refs: list[Any] = []

    def ref(r: re.Match[str]) -> str:
        refs.append(value(results, r.group(1), r.group(2)))
        return f"_{len(refs) - 1}"

    x = _evaluate(ast.parse(REF.sub(ref, expr), mode="eval"), refs)

    def one(v: Any) -> str:
        return format(v, spec) if spec else fmt(v)

    if isinstance(x, list) and len(x) == 2:
        return f"{one(x[0])}-{one(x[1])}"
    return one(x)


def render(template: str, results: dict[str, dict[str, Any]]) -> str:
    """``template`` with each result marker replaced by its section, each placeholder by its
    value; ``ValueError`` if one names no result or value."""
    missing = [m for m in MARKER.findall(template) if m not in results]
    if missing:
        raise ValueError(f"no result for {missing}: run its command, or pass its folder")
    prose = _reflow(VALUE.sub(lambda m: _figure(results, m), template))
    return MARKER.sub(lambda m: section(results[m.group(1)]), prose)


ITEM = re.compile(r"^(\s*(?:[-*]|\d+\.) )")
WIDTH = 95  # prose is rewrapped at this width once its figures are in (no ragged lines)


GLUE = re.compile(r"(?<=\d) (?=(?:ms|s|GB|MB|GiB|B|x|steps|bits|ranks?)\b)")
"""A number and its unit stay on one line."""


def _reflow(text: str) -> str:
    """Rewraps the prose paragraphs and list items of ``text`` (not tables, code, headings...)."""
    out: list[str] = []
    for block in text.split("\n\n"):
        lines = block.strip("\n").split("\n")
        keep = any(ln.lstrip().startswith(("|", "```", "<!--", "#", "![", ">"))
                   or ln.startswith("    ") for ln in lines)  # fmt: skip
        if keep or not block.strip():
            out.append(block)
            continue
        items: list[tuple[str, str, list[str]]] = []
        for line in lines:
            bullet = ITEM.match(line)
            if bullet or not items:
                lead = bullet.group(1) if bullet else line[: len(line) - len(line.lstrip())]
                items.append((lead, " " * len(lead), [line[len(lead) :].strip()]))
            else:
                items[-1][2].append(line.strip())
        wrapped = [
            textwrap.fill(GLUE.sub("\u00a0", " ".join(words)), WIDTH, initial_indent=first,
                          subsequent_indent=rest, break_long_words=False,
                          break_on_hyphens=False).replace("\u00a0", " ")
            for first, rest, words in items
        ]  # fmt: skip
        out.append("\n".join(wrapped))
    reflowed = "\n\n".join(out)
    return reflowed + "\n" if text.endswith("\n") and not reflowed.endswith("\n") else reflowed


def render_readme(readme: str, results: dict[str, dict[str, Any]]) -> str:
    """``readme`` with its figures block rendered from ``templates/readme/figures.md``."""
    if not README_BLOCK.search(readme):
        raise ValueError("README.md has no <!-- figures: begin --> ... end block")
    figures = render(README_FIGURES.read_text(), results)
    return README_BLOCK.sub(lambda m: m.group(1) + figures + m.group(2), readme)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("folders", type=Path, nargs="*", default=[RECORDED])
    p.add_argument("--docs", type=Path, default=Path("docs"), help="where the pages go")
    p.add_argument("--allow-smoke", action="store_true", help="render --smoke results too")
    p.add_argument("--readme", type=Path, default=README,
                   help="README whose figures block is rendered")  # fmt: skip
    p.add_argument("--render", type=Path, metavar="FILE",
                   help="print FILE rendered from the results; write no page")  # fmt: skip
    args = p.parse_args(argv)
    results = collect(args.folders, args.allow_smoke)
    if args.render is not None:
        sys.stdout.write(render(args.render.read_text(), results))
        return 0
    for template in sorted(TEMPLATES.glob("*.md")):
        page = args.docs / template.name
        header = (f"<!-- Generated by `python -m benchmarks.report` from benchmarks/templates/"
                  f"{template.name} and the JSON results: edit those, not this file. -->\n\n")  # fmt: skip
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(header + render(template.read_text(), results))
        print(f"wrote {page}", file=sys.stderr)
    args.readme.write_text(render_readme(args.readme.read_text(), results))
    print(f"wrote {args.readme}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
