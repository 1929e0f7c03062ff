"""Every command the docs show runs, as a user types it, and exits 0.

Command blocks (:mod:`tests.docs.markdown`) give commands or their synopses
(``cnr export ROOT --out DIR [--step S] [--format torch|safetensors]``). A synopsis runs
once with every optional part left out and once per alternative with every optional part
in; its placeholders name the docs' own fixtures: ``ROOT`` a root trained to step 500
with a checkpoint every 100 steps, ``DIR`` a fresh folder, ``S`` 500, ``MB`` 64, ``T`` a
type name; ``/ckpt/...`` and ``model.pt`` lie in the test's folder, ``job.yaml`` is the
demo's configuration on a small model. A command that trains on a shipped
``configs/*.yaml`` runs on its model shrunk (:data:`SHRINK`) for 40 steps, and
``/data/criteo/train.txt`` is a small file in Criteo's format. Commands the benchmarks' pages show are the benchmarks' own:
``tests/e2e/test_benchmarks_smoke.py`` runs each with ``--smoke``.
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import torchrec_cnr
from tests import BIN
from tests.docs.markdown import GENERATED, PAGES, REPO, blocks
from tests.docs.standins import EVERY, TRAINED, localize
from tests.e2e.test_criteo_data import _write_tsv as write_criteo_tsv
from torchrec_cnr import export_state_dict
from torchrec_cnr.offline import read_optimizer_state

SHRINK = (
    "data.batch_size=64",
    "model.max_rows=2000",
    "model.dim=16",
    "eval.batches=2",
    "failure.steps=[]",
    "train.figure_path=null",
    "train.metrics_path=null",
)
PLACEHOLDERS = {"S": str(TRAINED), "MB": "64", "T": "collections.OrderedDict"}


def expand(synopsis: str) -> list[str]:
    """The commands a synopsis stands for: every ``[optional]`` part out, then every one
    in, once per alternative of ``a|b`` (``...`` after a repeated part dropped)."""
    synopsis = synopsis.replace(" ...]", "]")
    optional = re.findall(r"\[([^\]]+)\]", synopsis)
    if not optional:
        return [synopsis]
    bare = " ".join(re.sub(r"\s*\[[^\]]+\]", "", synopsis).split())
    choices = [[_alternatives(part) for part in optional]]
    full = []
    for picked in itertools.product(*choices[0]):
        text = synopsis
        for part, choice in zip(optional, picked):
            text = text.replace(f"[{part}]", choice, 1)
        full.append(" ".join(text.split()))
    return [bare, *full]


def _alternatives(part: str) -> list[str]:
    """``--format torch|safetensors`` -> the part once with each value."""
    m = re.fullmatch(r"(.*?)(\S+\|\S+)(.*)", part)
    if m is None:
        return [part]
    return [m.group(1) + value + m.group(3) for value in m.group(2).split("|")]


def documented() -> list[tuple[str, str]]:
    """(where, command) for every command the hand-written pages show, in page order,
    each expanded synopsis once."""
    found: dict[str, str] = {}
    for page in PAGES:
        if page in GENERATED:
            continue
        for block in blocks(page):
            if not block.is_commands or block.skip:
                continue
            for number, command in enumerate(block.commands(), 1):
                if number in block.skip_commands:
                    continue
                for one in expand(command):
                    found.setdefault(one, f"{block.where}#{number}")
    return [(where, command) for command, where in found.items()]


class Folder:
    """The commands' world: a trained root, a job configuration, fresh output folders."""

    def __init__(self, tmp: Path, fixtures: Path) -> None:
        self.tmp = tmp
        shutil.copytree(fixtures / "testsparsenn" / "ckpt", tmp / "ckpt")
        self.root = str(tmp / "ckpt" / "run1")
        self.outputs: dict[str, subprocess.CompletedProcess[str]] = {}
        """Each command's process, by the command as documented."""
        self.outs = itertools.count()
        (tmp / "job.yaml").write_text((REPO / "configs" / "demo.yaml").read_text())
        self.app = tmp / "ckpt" / "app"
        """The app's own root, the DCP checkpoint of ``job.yaml``'s model comes from."""
        (tmp / "data" / "criteo").mkdir(parents=True)
        write_criteo_tsv(tmp / "data" / "criteo" / "train.txt", 12_000)

    def job(self, root: Path, steps: int) -> list[str]:
        """``job.yaml``'s overrides: the demo's model shrunk, fp32 checkpoints every 100 steps."""
        return [*SHRINK, "checkpoint.quantize.method=none", f"checkpoint.interval_steps={EVERY}",
                "train.verify_restore=false",
                f"checkpoint.path={root}", f"train.steps={steps}"]  # fmt: skip

    def argv(self, command: str) -> list[str]:
        words = shlex.split(localize(command, str(self.tmp)).replace("/data/", f"{self.tmp}/data/"))
        out: list[str] = []
        for word in words:
            if word == "ROOT":
                word = self.root
            elif word == "DIR":
                word = str(self.tmp / f"out{next(self.outs)}")
            elif word == "model.pt":
                word = str(self.tmp / "model.pt")
            elif word == "job.yaml":
                word = str(self.tmp / "job.yaml")
            word = PLACEHOLDERS.get(word, word)
            out.append(word)
        if out[0] in ("cnr", "cnr-train", "torchrun"):
            out[0] = str(BIN / out[0])
        if any(w.startswith("configs/") and w.endswith(".yaml") for w in out):
            trained = self.tmp / f"trained{next(self.outs)}"  # a root of its own
            out += [*SHRINK, "train.steps=40", f"checkpoint.path={trained}",
                    f"data.cache_dir={self.tmp / 'criteo_npy'}"]  # fmt: skip
        if str(self.tmp / "job.yaml") in out:
            out += self.job(self.tmp / "ckpt" / "job", TRAINED + EVERY)
        return out

    def run(self, command: str) -> subprocess.CompletedProcess[str]:
        proc = _run(self.argv(command))
        self.outputs[command] = proc
        return proc


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=280)


def _ok(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, f"{proc.args}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def _dcp_of_the_app(folder: Folder) -> None:
    """``/ckpt/dcp/step_500`` of the app's model, as ``job.yaml`` builds it: the app trained
    to step 500, exported by ``cnr export --format dcp``."""
    torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", "-m", "cnr_train"]
    _ok(_run([*torchrun, "run", "--config", str(folder.tmp / "job.yaml"),
              *folder.job(folder.app, TRAINED)]))  # fmt: skip
    shutil.rmtree(folder.tmp / "ckpt" / "dcp" / "step_500")  # the TorchRec model's
    out = localize("/ckpt/dcp/step_500", str(folder.tmp))
    _ok(_run([str(BIN / "cnr"), "export", str(folder.app), "--out", out, "--format", "dcp"]))


@pytest.fixture(scope="session")
def folder(tmp_path_factory: pytest.TempPathFactory, docs_fixtures: Path) -> Folder:
    made = Folder(tmp_path_factory.mktemp("commands"), docs_fixtures)
    _dcp_of_the_app(made)
    return made


COMMANDS = documented()


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("where, command", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_the_documented_command_runs(where: str, command: str, folder: Folder) -> None:
    _ok(folder.run(command))
    if command.startswith("cnr export ROOT --out model.pt") and "safetensors" not in command:
        got = torch.load(folder.tmp / "model.pt")
        want = torchrec_cnr.read_table(folder.root, "t_user", step=TRAINED)
        assert got["sparse.ebc.embedding_bags.t_user.weight"].equal(want)


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    return {prefix[:-1]: tree}


def _same_file(a: Path, b: Path, tmp: Path) -> None:
    """Two DCP checkpoints hold the same keys and values."""
    for d in (a, b):
        dcp_to_torch_save(d, tmp / f"{d.name}.pt")
    one = _flat(torch.load(tmp / f"{a.name}.pt", weights_only=False))
    two = _flat(torch.load(tmp / f"{b.name}.pt", weights_only=False))
    assert one.keys() == two.keys()
    for key, value in one.items():
        same = (
            torch.equal(value, two[key]) if isinstance(value, torch.Tensor) else value == two[key]
        )
        assert same, key


@pytest.mark.dist
def test_the_dcp_commands_export_in_parallel_as_alone_and_a_job_resumes_from_an_import(
    folder: Folder,
) -> None:
    """After the documented commands: the parallel export equals the single one; an
    existing ``--out`` is refused; the job started by ``import-dcp`` and resumed by ``run``
    ends where the root the DCP checkpoint came from ends when resumed alike."""
    single = "cnr export ROOT --out /ckpt/dcp_out --format dcp"
    parallel = "torchrun --standalone --nproc_per_node=2 -m torchrec_cnr.cli export ROOT --out DIR --format dcp"
    assert {single, parallel} <= folder.outputs.keys(), "run after the documented commands"
    printed = folder.outputs[parallel].stdout
    assert "rank 0 wrote" in printed and "rank 1 wrote" in printed
    assert "rank 1 wrote 0 blocks" not in printed  # both ranks wrote their share
    out = Path(folder.outputs[parallel].args[folder.outputs[parallel].args.index("--out") + 1])
    _same_file(Path(localize("/ckpt/dcp_out", str(folder.tmp))), out, folder.tmp)
    refused = folder.run(single)
    assert refused.returncode == 2 and "overwrite" in refused.stderr

    resumed = "torchrun --standalone --nproc_per_node=2 -m cnr_train run --config job.yaml train.clean_start=false"
    assert "resumed from step 500" in folder.outputs[resumed].stdout
    torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", "-m", "cnr_train"]
    proc = _ok(_run([*torchrun, "run", "--config", str(folder.tmp / "job.yaml"),
                     *folder.job(folder.app, TRAINED + EVERY), "train.clean_start=false"]))  # fmt: skip
    assert "resumed from step 500" in proc.stdout
    job = folder.tmp / "ckpt" / "job"
    want, got = (
        export_state_dict(folder.app, TRAINED + EVERY),
        export_state_dict(job, TRAINED + EVERY),
    )
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)
    for table in ("cat_0", "cat_9"):
        sa = read_optimizer_state(folder.app, table, TRAINED + EVERY)
        sb = read_optimizer_state(job, table, TRAINED + EVERY)
        assert all(torch.equal(sa[k], sb[k]) for k in sa if sa[k].dim()), table


def test_every_command_block_is_run_or_says_why() -> None:
    assert len(COMMANDS) >= 15
    texts = " ".join(c for _, c in COMMANDS)
    for needed in ("cnr inspect", "cnr verify", "cnr compact", "import-dcp", "torchrec_cnr.cli"):
        assert needed in texts, needed
