"""PyTorch DCP interop: a DCP checkpoint imports into any world size and layout exactly
as our own restore of the same step does, and as stock ``dcp.load`` does where it can;
an exported step loads with stock ``dcp.load`` into another world size and layout, into
an unsharded model and through ``dcp_to_torch_save``, and trains on bit-identically."""

from __future__ import annotations

import pickle
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.stateful import Stateful

from cnr_train.workload import TableSpec
from tests import models
from tests.jobs import Job, make_job
from tests.multiprocess import run_ranks
from torchrec_cnr import (
    CheckpointConfig,
    CheckpointManager,
    CheckpointReadError,
    IOOptions,
    ModelMismatchError,
    QuantizeConfig,
    export_dcp,
    read_table,
)
from torchrec_cnr.errors import ChecksumError
from torchrec_cnr.interop import ExportOptions
from torchrec_cnr.read import ChainReader, MemoryBudget, held_by_reads
from torchrec_cnr.storage import CountingStorage, open_storage
from torchrec_cnr.storage.fs import tree_bytes

STEP, MORE = 3, 2
EBC_FROM = {"t_column_wise": "column_wise", "w_table_row_wise": "table_row_wise"}
"""The source keeps every table's own layout (table-wise, column-wise, row-wise, table-row-
wise, ...) but these."""
ACROSS = {  # each table onto another layout
    "t_table_wise": "row_wise",
    "t_row_wise": "table_wise",
    "t_table_row_wise": "column_wise",
    "t_column_wise": "table_row_wise",
    "w_table_wise": "column_wise",
    "w_column_wise": "row_wise",
}
NO_COLUMNS = {
    "t_column_wise": "table_wise",
    "t_table_column_wise": "row_wise",
    "w_column_wise": "table_row_wise",
    "w_table_column_wise": "table_wise",
}
"""A source stock DCP loads onto another world size: TorchRec sizes a column-wise table's
row-wise optimizer state by its column shards, which then change."""
STOCK_ACROSS = {
    "t_table_wise": "row_wise",
    "t_row_wise": "table_row_wise",
    "w_table_wise": "row_wise",
}
"""Across layouts that stock DCP loads (no table leaves or enters column-wise)."""


def _stock_load(job: Job, checkpoint_id: str) -> None:
    """docs/migration.md's recipe: stock ``dcp.load`` into a fresh job, one call per object,
    the dense optimizer given a state for each parameter the checkpoint holds one for."""
    for group in job.dense_opt.param_groups:  # a state for dcp.load to fill in place
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    job.dense_opt.step()
    job.dense_opt.zero_grad(set_to_none=True)
    saved = dcp.FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
    sd = _recipe(job)
    sd["dense_opt"]["state"] = {
        i: s
        for i, s in sd["dense_opt"]["state"].items()
        if any(k.startswith(f"dense_opt.state.{i}.") for k in saved)
    }
    for key in sd:
        dcp.load({key: sd[key]}, checkpoint_id=checkpoint_id)
    job.model.load_state_dict(sd["model"])
    job.model.fused_optimizer.load_state_dict(sd["optim"])
    job.dense_opt.load_state_dict(sd["dense_opt"])


def _recipe(job: Job) -> dict[str, Any]:
    """TorchRec's DCP recipe: the model, its fused optimizer, the dense optimizer."""
    return {
        "model": job.model.state_dict(),
        "optim": job.model.fused_optimizer.state_dict(),
        "dense_opt": job.dense_opt.state_dict(),
    }


class _Holder:
    """An ``app_state`` object that is not the optimizer but forwards to it, as PyTorch's
    DCP recipe wraps one in a ``Stateful``."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt = opt

    def state_dict(self) -> dict[str, Any]:
        return self.opt.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.opt.load_state_dict(state_dict)


class _AppState(Stateful):
    """PyTorch's DCP recipe: one ``Stateful`` holding the model and its optimizers."""

    def __init__(self, job: Job) -> None:
        self.job = job

    def state_dict(self) -> dict[str, Any]:
        return _recipe(self.job)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise AssertionError("only saved here")


def _source(kind: str, layouts: dict[str, str], root: str, dcp_dir: str) -> None:
    """Trains STEP steps, then saves the step three ways: our checkpoint, TorchRec's DCP
    recipe, and PyTorch's (under ``app``, in ``<dcp_dir>_app``)."""
    job = make_job(kind, optimizer="exact_rowwise_adagrad", seed=1, layouts=layouts)
    with CheckpointManager(job.model, CheckpointConfig(path=root), job.app_state) as ckpt:
        job.run(1, STEP)
        ckpt.save(STEP)
    dcp.save(_recipe(job), checkpoint_id=dcp_dir)
    dcp.save({"app": _AppState(job)}, checkpoint_id=dcp_dir + "_app")


def _capture_after(job: Job, out: str) -> None:
    """Captures the job now and after MORE steps, as this rank's file under ``out``."""
    now = models.capture(job.model, job.app_state)
    job.run(STEP + 1, STEP + MORE)
    later = models.capture(job.model, job.app_state)
    with open(f"{out}.{dist.get_rank()}", "wb") as f:
        pickle.dump((now, later), f)


def _target(kind: str, layouts: dict[str, str], how: str, src: str, root: str, out: str) -> None:
    """Loads the step into a fresh job (another seed) ``how``, then trains on."""
    job = make_job(kind, optimizer="exact_rowwise_adagrad", seed=7, layouts=layouts)
    if how == "stock":  # stock DCP, as TorchRec's users load
        _stock_load(job, src)
        _capture_after(job, out)
        return
    # The Stateful recipe's import goes to an object that only forwards to the optimizer.
    app = {"dense_opt": _Holder(job.dense_opt)} if how == "import_app" else job.app_state
    with CheckpointManager(job.model, CheckpointConfig(path=root), app) as ckpt:
        if how.startswith("import"):
            keys = {"dense_opt": "app.dense_opt"} if how == "import_app" else None
            assert ckpt.restore(from_dcp=src, step=STEP, app_keys=keys) == STEP
        else:
            assert ckpt.restore(step=STEP) == STEP
        _capture_after(job, out)
        if how == "import":  # the next save is a baseline, and it restores what was imported
            ckpt.save(STEP + MORE)
            ckpt.wait()
            assert ckpt.restore() == STEP + MORE
            entry = ckpt._fence.manifest().latest()
            assert entry is not None and entry.depth == 1


def _export(root: str, out: str) -> None:
    options = ExportOptions(budget_mb=40_000 / 2**20)  # blocks of 40,000 bytes
    # On the last of several ranks another read of the process holds the whole budget: that
    # rank's share is a quarter of it, and every rank writes blocks of the least share.
    other = MemoryBudget(40_000)
    if 0 < dist.get_rank() == dist.get_world_size() - 1:
        assert other.take(40_000)
    export_dcp(root, out, STEP, options, group=dist.group.WORLD)


def _load(out: str) -> list[Any]:
    found = sorted(Path(out).parent.glob(Path(out).name + ".*"))
    return [pickle.loads(p.read_bytes()) for p in found]


def _same(want: str, got: str, scalars: bool) -> None:
    """Every rank's captures equal, now and after training on (the kernels' step
    counters only if ``scalars``: DCP's recipe does not hold them)."""
    a, b = _load(want), _load(got)
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        for cx, cy in zip(x, y):
            if not scalars:
                for c in (cx, cy):
                    for shard in c["shards"].values():
                        shard["scalars"] = {}
            problems = models.differences(cx, cy)
            assert not problems, problems[:5]


def _case(tmp_path: Path, kind: str, src_world: int, src: dict[str, str], dst_world: int,
          dst: dict[str, str], stock: bool) -> None:  # fmt: skip
    root, dcp_dir = str(tmp_path / "root"), str(tmp_path / "dcp")
    run_ranks(src_world, _source, kind, src, root, dcp_dir)
    o = tmp_path / "out"
    o.mkdir()
    run_ranks(dst_world, _target, kind, dst, "restore", "", root, str(o / "restore"))
    run_ranks(
        dst_world, _target, kind, dst, "import", dcp_dir, str(tmp_path / "r2"), str(o / "import")
    )
    _same(str(o / "restore"), str(o / "import"), scalars=False)
    run_ranks(
        dst_world,
        _target,
        kind,
        dst,
        "import_app",
        dcp_dir + "_app",
        str(tmp_path / "r4"),
        str(o / "import_app"),
    )
    _same(str(o / "import"), str(o / "import_app"), scalars=True)
    if stock:
        run_ranks(dst_world, _target, kind, dst, "stock", dcp_dir, "", str(o / "stock"))
        _same(str(o / "stock"), str(o / "import"), scalars=True)
    # Export the step of our root; stock DCP reads it as our restore reads the root.
    exported = str(tmp_path / "exported")
    run_ranks(src_world, _export, root, exported)
    if stock:
        run_ranks(dst_world, _target, kind, dst, "stock", exported, "", str(o / "stock_export"))
        _same(str(o / "restore"), str(o / "stock_export"), scalars=False)
    run_ranks(
        dst_world,
        _target,
        kind,
        dst,
        "import",
        exported,
        str(tmp_path / "r3"),
        str(o / "import_export"),
    )
    _same(str(o / "restore"), str(o / "import_export"), scalars=False)


@pytest.mark.dist
@pytest.mark.parametrize(
    "kind, src_world, src, dst_world, dst, stock",
    [
        ("ebc", 2, EBC_FROM, 2, EBC_FROM, True),
        ("ebc", 2, NO_COLUMNS, 1, {**NO_COLUMNS, **STOCK_ACROSS}, True),
        ("ebc", 1, EBC_FROM, 2, {**EBC_FROM, **ACROSS}, False),
        ("ebc", 2, EBC_FROM, 2, {**EBC_FROM, **ACROSS}, False),
        ("ec", 2, {"t_column_wise": "table_wise"}, 1, {"t_row_wise": "table_wise"}, True),
        ("ec", 2, {}, 2, {"t_column_wise": "row_wise", "t_row_wise": "column_wise"}, False),
    ],
)
def test_import_and_export_match_our_restore_and_stock_dcp(
    tmp_path: Path,
    kind: str,
    src_world: int,
    src: dict[str, str],
    dst_world: int,
    dst: dict[str, str],
    stock: bool,
) -> None:
    _case(tmp_path, kind, src_world, src, dst_world, dst, stock)


def _unsharded(exported: str, torch_save: str, want: str) -> None:
    """Without a process group: stock DCP into the unsharded model, and the torch file."""
    assert not dist.is_initialized()
    module, _, _ = models.unsharded("ebc", device="cpu")
    sd = {"model": module.state_dict()}
    dcp.load(sd, checkpoint_id=exported, no_dist=True)
    module.load_state_dict(sd["model"])
    expected = torch.load(want)
    for key, value in module.state_dict().items():
        assert torch.equal(value, expected[key]), key
    dcp_to_torch_save(exported, torch_save)
    whole = torch.load(torch_save, weights_only=False)
    for key, value in expected.items():
        assert torch.equal(whole["model"][key], value), key
    opt = whole["optim"]["state"]["sparse.ebc.embedding_bags.t_column_wise.weight"]
    assert opt["t_column_wise.momentum1"].shape == (2 * 301,)  # two column shards


def test_export_loads_into_an_unsharded_model_and_a_torch_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHREC_CNR_OBJECT_MB", str(8 / 1024))  # checksummed in 8 KiB blocks
    root, dcp_dir = str(tmp_path / "root"), str(tmp_path / "dcp")
    run_ranks(2, _source, "ebc", EBC_FROM, root, dcp_dir)
    from torchrec_cnr import export_state_dict

    want = tmp_path / "want.pt"
    torch.save(export_state_dict(root, STEP), want)
    exported = str(tmp_path / "exported")
    export_dcp(root, exported)  # one process, no process group
    _unsharded(exported, str(tmp_path / "whole.pt"), str(want))
    with pytest.raises(FileExistsError, match="overwrite"):
        export_dcp(root, exported)
    export_dcp(root, exported, options=ExportOptions(overwrite=True))
    # Blocks of 32 KiB, far smaller than the saved shards: each reads only the stored blocks
    # its rows lie in, not every saved shard it overlaps whole.
    counting, small = CountingStorage(open_storage(root)), str(tmp_path / "small")
    export_dcp(counting, small, options=ExportOptions(budget_mb=1 / 16))
    _unsharded(small, str(tmp_path / "small.pt"), str(want))
    stored = tree_bytes(root)
    assert counting.bytes_read < 2 * stored, (counting.bytes_read, stored)


CHAIN_TABLES = [
    TableSpec("a", 600, 8, "table_wise"),
    TableSpec("b", 300, 8, "column_wise"),
    TableSpec("c", 401, 8, "row_wise"),
]


def _chain(root: str, policy: str, quantize: QuantizeConfig) -> None:
    job = make_job(CHAIN_TABLES, root, seed=1, policy=policy, alpha=1.3, quantize=quantize)
    for step in range(2, 11, 2):
        job.train(2)
        job.ckpt.save(step)
    job.ckpt.close()


@pytest.mark.dist
@pytest.mark.parametrize(
    ("policy", "bits"), [("intermittent", 4), ("consecutive", None)], ids=["tail-4bit", "fp32"]
)
def test_an_export_in_blocks_smaller_than_the_saved_shards_equals_one_in_whole_tables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy: str, bits: int | None
) -> None:
    """A chain of deltas (cumulative ones store their latest rows last, out of order),
    quantized or not: blocks of 1 KiB read each saved shard's landing rows alone (by one
    writer thread or by three at once, or beside another read of the process), the whole
    tables read each saved shard whole; all give the same tensors."""
    monkeypatch.setenv("TORCHREC_CNR_OBJECT_MB", str(4 / 1024))
    quantize = (
        QuantizeConfig(method="adaptive", bits=bits, min_rows=0) if bits else QuantizeConfig()
    )
    root = str(tmp_path / "root")
    run_ranks(2, _chain, root, policy, quantize)
    with ChainReader.open(root) as chain:
        assert len(chain.links) > 1, "a baseline and deltas"
    got, blocks = {}, {}
    other = MemoryBudget(2048)
    tiny = IOOptions(read_memory_mb=1 / 512)  # the bound of every read, where none is given
    for name, options, io in (
        ("small", ExportOptions(budget_mb=1 / 512), None),
        ("threads", ExportOptions(budget_mb=1 / 512, threads=3), None),
        ("io", ExportOptions(), tiny),
        ("whole", ExportOptions(budget_mb=64), tiny),  # the export's own budget wins
        ("shared", ExportOptions(budget_mb=1 / 512), None),
    ):
        if name == "shared":  # another read of the process holds the whole budget
            assert other.take(2048)  # (1 / 512 MB): the export takes a quarter of it
        blocks[name] = export_dcp(root, str(tmp_path / name), options=options, io=io).blocks
        dcp_to_torch_save(str(tmp_path / name), str(tmp_path / f"{name}.pt"))
        got[name] = torch.load(str(tmp_path / f"{name}.pt"), weights_only=False)
    assert blocks["io"] == blocks["small"] > blocks["whole"], blocks
    assert blocks["shared"] > blocks["small"], blocks
    other.release()
    # Two exports at once in one process share the budget: the second, begun while the
    # first holds all of it, cuts blocks of a quarter; both give back what they held.
    before = held_by_reads()
    first_holds, second_wrote = threading.Event(), threading.Event()

    def export(which: int) -> int:
        def progress(done: int, total: int) -> None:
            if which == 0:
                first_holds.set()
                assert second_wrote.wait(120), "the second export wrote nothing"
            else:
                second_wrote.set()

        options = ExportOptions(budget_mb=1 / 512, progress=progress)
        name = f"at_once{which}"
        done = export_dcp(root, str(tmp_path / name), options=options).blocks
        dcp_to_torch_save(str(tmp_path / name), str(tmp_path / f"{name}.pt"))
        got[name] = torch.load(str(tmp_path / f"{name}.pt"), weights_only=False)
        return done

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(export, 0)
        assert first_holds.wait(120), "the first export wrote nothing"
        second = pool.submit(export, 1)
        at_once = [first.result(timeout=300), second.result(timeout=300)]
    assert at_once == [blocks["small"], blocks["shared"]], (at_once, blocks)
    assert held_by_reads() == before
    for name in ("at_once0", "at_once1"):
        assert models.differences(got["whole"], got[name]) == [], name
    for name in ("small", "threads", "io", "shared"):
        assert models.differences(got["whole"], got[name]) == [], name
    for spec in CHAIN_TABLES:
        key = f"sparse_arch.embedding_bag_collection.embedding_bags.{spec.name}.weight"
        assert torch.equal(got["small"]["model"][key], read_table(root, spec.name))


def _export_of_damaged_root(root: str, out: str) -> None:
    with pytest.raises(ChecksumError):
        options = ExportOptions(overwrite=True)
        export_dcp(root, out, options=options, group=dist.group.WORLD)


@pytest.mark.dist
def test_an_export_that_fails_leaves_the_earlier_export_whole_and_nothing_of_its_own(
    tmp_path: Path,
) -> None:
    """With ``overwrite``, an export of a root damaged since the earlier export fails on
    every rank (2, as under torchrun); the earlier export stays whole at ``out`` (a link to
    a folder, which stays a link), and no partial folder is left beside it."""
    root, out = str(tmp_path / "root"), tmp_path / "exports" / "out"
    (tmp_path / "exports" / "real").mkdir(parents=True)
    out.symlink_to(tmp_path / "exports" / "real")
    run_ranks(2, _chain, root, "consecutive", QuantizeConfig())
    export_dcp(root, str(out))
    dcp_to_torch_save(str(out), str(tmp_path / "before.pt"))
    latest = Path(root, ChainReader.open(root).entry.id)
    objects = [p for p in (latest / "data").rglob("*") if p.is_file()]
    largest = max(objects, key=lambda p: p.stat().st_size)
    with open(largest, "r+b") as f:  # one byte of the latest checkpoint's largest object
        f.seek(largest.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    run_ranks(2, _export_of_damaged_root, root, str(out))
    assert sorted(p.name for p in out.parent.iterdir()) == ["out", "real"]
    assert out.is_symlink() and (out / ".metadata").exists()
    dcp_to_torch_save(str(out), str(tmp_path / "after.pt"))
    before, after = (
        torch.load(tmp_path / f"{n}.pt", weights_only=False) for n in ("before", "after")
    )
    assert models.differences(before, after) == []


def _wrong_model(dcp_dir: str, root: str) -> None:
    job = make_job("ec", optimizer="exact_rowwise_adagrad", seed=7)
    before = models.capture(job.model, job.app_state)
    with CheckpointManager(job.model, CheckpointConfig(path=root), job.app_state) as ckpt:
        with pytest.raises(ModelMismatchError, match="holds none of the model's tables"):
            ckpt.restore(from_dcp=dcp_dir)
    assert not models.differences(before, models.capture(job.model, job.app_state))


def _no_optimizer_state(dcp_dir: str, root: str) -> None:
    job = make_job("ebc", optimizer="exact_rowwise_adagrad", seed=7, layouts=EBC_FROM)
    sd = job.model.state_dict()
    dcp.load(sd, checkpoint_id=dcp_dir)  # what the import must give the rows
    want = {
        k: [s.tensor.clone() for s in v.local_shards()]
        for k, v in sd.items()
        if hasattr(v, "local_shards")
    }
    job = make_job("ebc", optimizer="exact_rowwise_adagrad", seed=8, layouts=EBC_FROM)
    job.step(1)  # its optimizer state is not zero
    with CheckpointManager(job.model, CheckpointConfig(path=root), job.app_state) as ckpt:
        with pytest.warns(UserWarning, match="no optimizer state"):
            ckpt.restore(from_dcp=dcp_dir)
    got = job.model.state_dict()
    for key, value in want.items():
        assert all(torch.equal(s.tensor, v) for s, v in zip(got[key].local_shards(), value)), key
    for states in job.model.fused_optimizer.state_dict()["state"].values():
        for st in states.values():
            assert all(not s.tensor.any() for s in st.local_shards())


def _wrong_shape(dcp_dir: str, root: str) -> None:
    """A checkpoint of the model with one table of another size: refused, naming it."""
    job = make_job("ebc", optimizer="exact_rowwise_adagrad", seed=1, layouts=EBC_FROM)
    sd = _recipe(job)
    sd["model"]["sparse.ebc.embedding_bags.t_table_wise.weight"] = torch.zeros(300, 16)
    dcp.save(sd, checkpoint_id=dcp_dir)
    job = make_job("ebc", optimizer="exact_rowwise_adagrad", seed=7, layouts=EBC_FROM)
    before = models.capture(job.model, job.app_state)
    with CheckpointManager(job.model, CheckpointConfig(path=root), job.app_state) as ckpt:
        want = r"t_table_wise.weight: \(300, 16\) in the checkpoint, \(301, 16\) in the model"
        with pytest.raises(ModelMismatchError, match=want):
            ckpt.restore(from_dcp=dcp_dir)
    assert not models.differences(before, models.capture(job.model, job.app_state))


def _damaged(dcp_dir: str, root: str) -> None:
    job = make_job("ebc", optimizer="exact_rowwise_adagrad", seed=7, layouts=EBC_FROM)
    with CheckpointManager(job.model, CheckpointConfig(path=root), job.app_state) as ckpt:
        with pytest.raises(CheckpointReadError, match="distcp"):
            ckpt.restore(from_dcp=dcp_dir)


def _flat_save(dcp_dir: str) -> None:
    job = make_job("ebc", optimizer="exact_rowwise_adagrad", seed=1, layouts=EBC_FROM)
    job.run(1, STEP)
    dcp.save(job.model.state_dict(), checkpoint_id=dcp_dir)


@pytest.mark.dist
def test_bad_dcp_input_fails_before_anything_changes(tmp_path: Path) -> None:
    root, dcp_dir = str(tmp_path / "root"), str(tmp_path / "dcp")
    run_ranks(2, _source, "ebc", EBC_FROM, root, dcp_dir)
    run_ranks(2, _wrong_model, dcp_dir, str(tmp_path / "r1"))
    run_ranks(2, _wrong_shape, str(tmp_path / "shape"), str(tmp_path / "r4"))
    (tmp_path / "dcp" / "__1_0.distcp").unlink()  # rank 1's file: every rank fails alike
    run_ranks(2, _damaged, dcp_dir, str(tmp_path / "r3"))
    flat = str(tmp_path / "flat")  # a flat model state dict, without optimizer state
    run_ranks(2, _flat_save, flat)
    run_ranks(2, _no_optimizer_state, flat, str(tmp_path / "r2"))


def _staged_tables_say_what_their_buffers_are() -> None:
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    from torchrec_cnr.interop.dcp_stager import _address, _restage
    from torchrec_cnr.tracking import model_state

    job = make_job("ebc", optimizer="exact_adagrad", seed=1)
    # Every table staged into a buffer that is pinned, as the stager's are where the tables
    # are on a GPU (CPU builds cannot pin: the buffers say so through is_pinned).
    copies, pinned = {}, set()
    for s in model_state.local_shards(job.model):
        for live in [s.weight, *s.states.values()]:
            copies[_address(live)] = buffer = live.detach().clone()
            pinned.add(buffer.data_ptr())
    real = torch.Tensor.is_pinned
    torch.Tensor.is_pinned = lambda self, *a: self.data_ptr() in pinned or real(self, *a)  # type: ignore[method-assign]
    try:
        staged, _ = _restage(job.model.state_dict(), copies)
    finally:
        torch.Tensor.is_pinned = real  # type: ignore[method-assign]
    tables = [v for v in staged.values() if isinstance(v, ShardedTensor)]
    assert tables, "the model's state dict holds no ShardedTensor"
    for t in tables:
        assert t.metadata().tensor_properties.pin_memory
        assert all(s.tensor.data_ptr() in pinned for s in t.local_shards())


@pytest.mark.dist
def test_staged_sharded_tensors_carry_the_pinning_of_their_buffers() -> None:
    # On a GPU, DCP's async_save with the stager failed: ShardedTensor refused host shards
    # in pinned buffers under metadata that said unpinned.
    run_ranks(1, _staged_tables_say_what_their_buffers_are)


def test_a_shard_on_a_gpu_is_staged_on_the_host_of_its_rank() -> None:
    from torch.distributed._shard.metadata import ShardMetadata

    from torchrec_cnr.interop.dcp_stager import _on_host

    got = _on_host(ShardMetadata([0, 8], [4, 8], "rank:3/cuda:1"))
    assert str(got.placement) == "rank:3/cpu"
    assert (got.shard_offsets, got.shard_sizes) == ([0, 8], [4, 8])


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor of a state dict in order, this rank's shards of a sharded one."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(obj, ShardedTensor):
        return [s.tensor for s in obj.local_shards()]
    if isinstance(obj, dict):
        return [t for k in sorted(obj) for t in _tensors(obj[k])]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors(v)]
    return [obj] if isinstance(obj, torch.Tensor) else []


def _stagings_interrupted_anywhere() -> None:
    from tests.faults import cut_at
    from torchrec_cnr.interop import DcpStager
    from torchrec_cnr.tracking import model_state

    job = make_job("ebc", optimizer="exact_adagrad", seed=1)
    job.train(2)
    stager = DcpStager(job.model)
    lookups = {id(s.lookups): s.lookups for s in model_state.local_shards(job.model)}

    def state() -> dict[str, Any]:  # TorchRec's recipe, as DCP hands it to the stager
        return {"model": job.model.state_dict(), "optim": job.model.fused_optimizer.state_dict()}

    def staged_at(at: int | None) -> tuple[Any, int]:
        return cut_at(at, lambda: stager.stage(state()))

    future, lines = staged_at(None)
    future.result()
    cut = 0
    for at in sorted({*range(1, 9), *(i * lines // 13 for i in range(1, 13))}):
        job.train(1)
        future, _ = staged_at(at)
        cut += future is None
        if future is not None:
            future.result()
        stager._executor.submit(lambda: None).result()  # what it may have queued has run
        hooked = [lk for lk in lookups.values() if lk is not None and lk.listened]
        assert not hooked, f"staging cut at line {at} of {lines} left a hook copying rows"
    assert cut >= 16, f"only {cut} stagings were cut short"
    # Staging goes on as before: a copy of the state at the call, whatever training does.
    job.train(1)
    want = [t.clone() for t in _tensors(state())]
    future, _ = staged_at(None)
    job.train(2)
    got = _tensors(future.result())
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    now = _tensors(state())
    assert any(not torch.equal(a, b) for a, b in zip(now, want)), "training changed nothing"
    stager.close()


@pytest.mark.dist
def test_a_dcp_staging_interrupted_at_any_line_leaves_no_hook_and_stages_exactly_after() -> None:
    """KeyboardInterrupt from inside ``DcpStager.stage`` (each of its first 8 lines of the
    library's code, then 12 spread over the rest): no copy-on-write hook is left copying
    rows into buffers nobody reads, and the next staging holds the state at its call."""
    run_ranks(1, _stagings_interrupted_anywhere)
