"""A restore runs no code from the checkpoint it reads.

A root can come from anyone: an ``app_state`` pickle that names ``os.system`` is refused
on every rank before anything changes, and nothing it names runs. Types beyond tensors,
numbers, strings and plain containers load only when listed in
``CheckpointConfig.safe_globals``.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from cnr_train.workload import TableSpec, ZipfBatches, build_model, dense_optimizer
from tests.models import capture, differences
from tests.multiprocess import run_ranks
from torchrec_cnr import CheckpointConfig, CheckpointManager
from torchrec_cnr.errors import UnsafeObjectError
from torchrec_cnr.snapshot.objects import load_object, resolve_globals

TABLES = [TableSpec("a", 600, 8, "table_wise"), TableSpec("b", 400, 8, "column_wise")]


class _RunsCommand:
    """Pickles as a call to ``os.system(command)``: what a crafted root holds."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (self.command,)


@dataclass
class ReaderPosition:
    """A user's own type in ``app_state``: harmless, but not built in."""

    epoch: int
    offset: int


class _Holder:
    """An ``app_state`` object whose state is whatever it was given."""

    def __init__(self, state: Any = None) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.state}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.state = sd["value"]


def _manager(root: str, extra: _Holder, seed: int, **config: Any) -> tuple[Any, dict[str, Any]]:
    model = build_model(TABLES, seed=seed)
    app = {
        "reader": ZipfBatches(TABLES, batch_size=8, seed=0),
        "dense_opt": dense_optimizer(model),
        "extra": extra,
    }
    return CheckpointManager(model, CheckpointConfig(path=root, **config), app), app


def _refuses_code_and_changes_nothing(root: str, marker: str) -> None:
    rank = dist.get_rank()
    writer, _ = _manager(root, _Holder(_RunsCommand(f"touch {marker}.{rank}")), seed=1)
    writer.save(1)
    writer.close()
    assert not Path(f"{marker}.{rank}").exists(), "saving must not run the object"

    ckpt, app = _manager(root, _Holder("mine"), seed=2)
    before = capture(ckpt.model, app)
    with pytest.raises(UnsafeObjectError) as caught:
        ckpt.restore()
    message = str(caught.value)
    assert "system" in message and "CheckpointConfig.safe_globals" in message, message
    assert not Path(f"{marker}.{rank}").exists(), "the restore ran code from the checkpoint"
    assert differences(before, capture(ckpt.model, app)) == []
    assert app["extra"].state == "mine"
    ckpt.close()


@pytest.mark.dist
def test_app_state_pickle_naming_code_is_refused_on_every_rank_and_nothing_runs(
    root: str, tmp_path: Path
) -> None:
    run_ranks(2, _refuses_code_and_changes_nothing, root, str(tmp_path / "ran"))
    assert list(tmp_path.glob("ran*")) == []


def _custom_type_needs_listing(root: str) -> None:
    rank = dist.get_rank()
    saved = ReaderPosition(epoch=3, offset=100 + rank)
    writer, _ = _manager(root, _Holder(saved), seed=1)
    writer.save(1)
    writer.close()
    name = f"{ReaderPosition.__module__}.{ReaderPosition.__qualname__}"

    ckpt, app = _manager(root, _Holder(), seed=2)
    before = capture(ckpt.model, app)
    with pytest.raises(UnsafeObjectError, match=name.replace(".", r"\.")):
        ckpt.restore()
    assert differences(before, capture(ckpt.model, app)) == []
    ckpt.close()

    ckpt, app = _manager(root, _Holder(), seed=2, safe_globals=(name,))
    assert ckpt.restore() == 1
    assert app["extra"].state == saved
    ckpt.close()


@pytest.mark.dist
def test_custom_app_state_types_restore_only_when_listed_in_safe_globals(root: str) -> None:
    run_ranks(2, _custom_type_needs_listing, root)


def _pickled(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_load_object_refuses_a_global_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    blob = _pickled({"x": _RunsCommand(f"touch {marker}")})
    with pytest.raises(UnsafeObjectError, match="system") as caught:
        load_object(blob, (), "app_state of rank 0")
    assert "app_state of rank 0" in str(caught.value)
    assert not marker.exists()


def test_load_object_builds_plain_state_and_listed_types() -> None:
    plain = {"step": 3, "name": "r", "t": torch.arange(4), "nested": [1.5, (2, "x")]}
    got = load_object(_pickled(plain), (), "plain")
    assert got["step"] == 3 and got["nested"] == [1.5, (2, "x")]
    assert torch.equal(got["t"], torch.arange(4))
    position = ReaderPosition(1, 2)
    with pytest.raises(UnsafeObjectError, match="ReaderPosition"):
        load_object(_pickled(position), (), "position")
    assert load_object(_pickled(position), [ReaderPosition], "position") == position


def test_safe_globals_names_resolve_or_fail_naming_the_option() -> None:
    name = f"{ReaderPosition.__module__}.{ReaderPosition.__qualname__}"
    assert resolve_globals([name, ReaderPosition]) == [ReaderPosition, ReaderPosition]
    with pytest.raises(ValueError, match="safe_globals.*'no_such_module.Thing'"):
        resolve_globals(["no_such_module.Thing"])
    with pytest.raises(ValueError, match="safe_globals"):
        CheckpointConfig(path="/tmp/x", safe_globals=("Thing",))
    assert CheckpointConfig(path="/tmp/x", safe_globals=[name]).safe_globals == (name,)  # type: ignore[arg-type]
