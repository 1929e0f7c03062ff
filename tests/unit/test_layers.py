"""The library reads as its pipeline: no import cycle, each stage imports only earlier
stages, and nothing of the training application (YAML, progress bars, cnr_train)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "torchrec_cnr"

# The pipeline, in order; a module may import its own stage and the stages before it.
STAGES = [
    (
        "errors",
        "lazy",
        "env",
        "units",
        "versions",
        "native",
        "shutdown",
        "launch",
        "iocontext",
        "schema",
        "collectives",
        "rowcopy",
        "quantization",
    ),  # fmt: skip
    ("tracking",),
    ("selection",),
    ("storage",),
    ("config",),
    ("recovery",),
    ("snapshot",),
    ("staging",),
    ("encoding",),
    ("manifest",),
    ("commit",),
    ("read",),
    ("restore",),
    ("compaction",),
    ("writer_process",),
    ("offline",),
    ("interop",),
    ("serving",),
    ("manager",),
    ("trainers",),
    ("testing",),
    ("cli", "__init__"),
]
RANK = {name: i for i, names in enumerate(STAGES) for name in names}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Modules and packages ``path`` imports, anywhere in it (functions included).

    ``from pkg import mod`` counts as importing ``pkg.mod`` when that is one of ``modules``.
    """
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{alias.name}" for alias in node.names} & set(modules)
            found.update(subs or {node.module})
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {
        name: {m for m in _imports(path, set(modules)) if m in modules and m != name}
        for name, path in modules.items()
    }


def _stage(module: str) -> int:
    parts = module.split(".")
    return RANK[parts[1] if len(parts) > 1 else "__init__"]


def test_no_module_of_the_library_imports_itself_back() -> None:
    graph = _graph()
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep) :] + [dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, [*path, dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_every_module_of_the_library_belongs_to_a_stage() -> None:
    unknown = sorted(m for m in _graph() if m != "torchrec_cnr" and m.split(".")[1] not in RANK)
    assert not unknown, f"modules in no stage of STAGES: {unknown}"


def _numbered() -> dict[str, int]:
    """The pipeline's numbering, from the one place it is written: the package docstring."""
    text = (PACKAGE / "__init__.py").read_text()
    doc = ast.get_docstring(ast.parse(text)) or ""
    return {name: int(n) for n, name in re.findall(r"^(\d+)\. ``(\w+)``", doc, re.MULTILINE)}


def test_the_pipeline_is_numbered_once_and_followed_everywhere() -> None:
    numbered = _numbered()
    assert list(numbered.values()) == list(range(1, len(numbered) + 1)), numbered
    # Each stage after the one before it in the import order.
    ranks = [RANK[name] for name in numbered]
    assert ranks == sorted(ranks) and len(set(ranks)) == len(ranks), numbered
    for package in sorted(p.parent for p in PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
        said = re.match(r"Stage (\d+):", doc)
        want = numbered.get(package.name)
        assert (int(said.group(1)) if said else None) == want, (
            f"{package.name}/__init__.py says {said.group(0) if said else 'no stage'}, "
            f"the package docstring numbers it {want}"
        )
    design = (PACKAGE.parent / "docs" / "design.md").read_text()
    in_design = {
        name: int(n) for name, n in re.findall(r"^  (\w+)/ +(\d+)\. ", design, re.MULTILINE)
    }
    assert in_design == numbered


def test_readers_depend_on_the_manifest_not_on_the_write_side() -> None:
    """The manifest sits below the commit and every reader: a reader of checkpoints (the
    chain reader, restores, the follower, the catalog) imports nothing of ``commit``."""
    readers = ("read", "restore", "serving", "offline")
    wrong = sorted(
        f"{module} imports {dep}"
        for module, deps in _graph().items()
        if module.split(".")[1:2] and module.split(".")[1] in readers
        for dep in deps
        if dep.startswith("torchrec_cnr.commit")
    )
    assert not wrong, wrong


def test_storage_holds_backends_only() -> None:
    """Storage knows nothing of the format or the pipeline: it imports no other stage but
    the leaves it shares with everything (the exceptions, the environment's parser, the
    size unit and the I/O options, which import nothing of ours but those two)."""
    graph = _graph()
    leaves = {
        "torchrec_cnr.env",
        "torchrec_cnr.errors",
        "torchrec_cnr.units",
        "torchrec_cnr.iocontext",
    }
    for leaf in leaves:
        assert not [d for d in graph[leaf] if d not in leaves], leaf
    late = {
        f"{module} imports {dep}"
        for module, deps in graph.items()
        if module.startswith("torchrec_cnr.storage")
        for dep in deps
        if not dep.startswith("torchrec_cnr.storage") and dep not in leaves
    }
    assert not late, sorted(late)


def test_each_stage_imports_only_itself_and_earlier_stages() -> None:
    late = [
        f"{module} (stage {_stage(module)}) imports {dep} (stage {_stage(dep)})"
        for module, deps in _graph().items()
        if module != "torchrec_cnr"
        for dep in deps
        if dep != "torchrec_cnr" and _stage(dep) > _stage(module)
    ]
    assert not late, "\n".join(late)


def test_the_library_needs_no_yaml_no_progress_bar_and_no_training_application() -> None:
    banned = ("yaml", "tqdm", "matplotlib", "cnr_train")
    found = {
        f"{path.relative_to(PACKAGE.parent)}: {m}"
        for path in PACKAGE.rglob("*.py")
        for m in _imports(path, set())
        if m.split(".")[0] in banned
    }
    assert not found, sorted(found)


@pytest.mark.parametrize(
    "module", ["torchrec_cnr.writer_process.server", "torchrec_cnr.cli", "torchrec_cnr"]
)
def test_a_process_that_needs_no_model_imports_no_torchrec(module: str) -> None:
    # The writer process and the command line import torch, not TorchRec (about 1 s on two
    # cores each time one starts), FBGEMM, torchsnapshot's package (which imports FBGEMM) or
    # DCP (0.6 s each); a name of a package's __all__ imports on first use.
    heavy = ("torchrec", "fbgemm_gpu", "torchsnapshot", "torch.distributed.checkpoint")
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m in {heavy!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_public_name_that_needs_torchrec_imports_it_on_first_use() -> None:
    got = subprocess.run(
        [sys.executable, "-c", "import torchrec_cnr; print(torchrec_cnr.tracking_sharders)"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "function tracking_sharders" in got.stdout


def test_dir_of_a_lazy_package_lists_its_public_names_before_they_import() -> None:
    code = (
        "import sys, torchrec_cnr, torchrec_cnr.tracking as t, torchrec_cnr.interop as i\n"
        "import torchrec_cnr.writer_process as w\n"
        "for p in (torchrec_cnr, t, i, w):\n"
        "    missing = set(p.__all__) - set(dir(p))\n"
        "    assert not missing, (p.__name__, missing)\n"
        "print(sorted(m for m in sys.modules if m == 'torchrec'))"
    )
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert got.returncode == 0 and got.stdout.strip() == "[]", got.stdout + got.stderr
