"""Exporting a committed step as a DCP checkpoint a job trains on from with stock DCP.

The checkpoint holds what ``dcp.save`` holds after TorchRec's recipe
``dcp.save({"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict(),
**app_state})``:

- ``model.<key>``: every table under the key the unsharded module's ``state_dict()``
  gives it (``model.sparse.ebc.embedding_bags.t0.weight``), ``(rows, dim)`` fp32, and
  the dense state (dense parameters, buffers, data-parallel tables);
- ``optim.state.<table key>.<table>.<state>``: the fused optimizer's state under the keys
  ``fused_optimizer.state_dict()`` uses (``t0.momentum1``). A per-element state is
  ``(rows, dim)``. A per-row state is ``(rows,)``, or, for a table saved column-wise in
  ``k`` column shards, ``(k * rows,)`` with shard ``j``'s rows at ``j * rows``, as
  TorchRec lays it out;
- ``<name>.<...>``: each ``app_state`` object's ``state_dict()`` as saved by rank 0 (the
  dense optimizer), nested as it was.

Quantized rows are written dequantized. The kernels' step counters (``iter``) are not
written: ``fused_optimizer.state_dict()`` does not hold them.

Every table is written in blocks, each read from the chain only as DCP's writer reaches the
block before it (with one writer thread, the next block is read while one is written: two
blocks of at most half ``ExportOptions.budget_mb`` each; with more, one block of at most
``budget_mb`` per thread), within what the process's other reads leave of it
(:class:`~torchrec_cnr.read.MemoryBudget`). The blocks' memory is kept for the process's
next export when this one ends, its pages lazily freed (the kernel takes them back when it
needs memory). Under ``torchrun`` every rank writes its share of the blocks into its own
files in parallel; rank 0 writes the metadata.

The export is written into a hidden folder beside ``out`` (``.NAME.partial``), which takes
``out``'s name once every rank has written its part: an export that fails (a full disk
says so) leaves ``out`` as it was and removes what it wrote.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from torchrec_cnr.collectives import Collective
from torchrec_cnr.config import checked_safe_globals
from torchrec_cnr.interop.dcp_io import Block, fused_state_path, mapped, write_blocks
from torchrec_cnr.iocontext import IOContext, IOOptions
from torchrec_cnr.manifest import TableShape
from torchrec_cnr.offline.export import progress_line
from torchrec_cnr.read.chain import ChainReader
from torchrec_cnr.read.items import MemoryBudget, ReadItem
from torchrec_cnr.read.tables import table_block
from torchrec_cnr.schema import ShardRecord
from torchrec_cnr.snapshot.objects import load_object, resolve_globals
from torchrec_cnr.storage import Root
from torchrec_cnr.storage.fs import fsync_dir
from torchrec_cnr.tracking.shard import ShardSpec
from torchrec_cnr.units import check_size_mb

__all__ = ["DcpExport", "ExportOptions", "export_dcp", "progress_line", "terminal_progress"]

MODEL, OPTIM = "model", "optim"
"""The top-level keys of TorchRec's DCP recipe."""

T = TypeVar("T")

Progress = Callable[[int, int], None]
"""Called after each block a rank writes, with its blocks done and its blocks in all."""


BUDGET_MB = 256
"""The blocks a rank holds in an export, in MB, where neither ``ExportOptions.budget_mb``
nor ``IOOptions.read_memory_mb`` is set."""


@dataclass(frozen=True)
class ExportOptions:
    """Options of :func:`export_dcp`: how large its blocks are, what it may replace and load,
    and how many threads write.

    Example::

        export_dcp(root, "/ckpt/dcp_out", options=ExportOptions(budget_mb=64, overwrite=True))
    """

    budget_mb: float | None = None
    """The blocks (a table's rows and their optimizer states) a rank holds, in MB
    (``None``: ``io.read_memory_mb``, the bound of every read, else :data:`BUDGET_MB`): with
    one writer thread, two of at most half this each (the next read while one is written);
    with more, one of at most this per thread. Plus what a block is read from: each saved
    shard wholly in it, one at a time, and the stored rows of each partly in it that land
    (in the checksummed blocks they lie in; in roots written before block checksums, the
    saved shard whole). At least 1 KiB (``1 / 1024``)."""
    overwrite: bool = False
    """Replace ``out`` if it exists, once the new export is whole (one that fails leaves it
    as it was; meanwhile the disk holds both); otherwise an existing ``out`` is refused
    before anything is written."""
    safe_globals: tuple[str | type, ...] = ()
    """Types ``app_state`` may hold beyond the built-in ones, as
    :attr:`~torchrec_cnr.CheckpointConfig.safe_globals` (``"package.module.Name"`` or the
    type itself)."""
    threads: int = 1
    """DCP's writer threads per rank, each writing its own file (and holding its own block)."""
    progress: Progress | None = None
    """Called after each block this rank writes, with its blocks done and its blocks in all
    (:func:`terminal_progress` prints them); ``None`` reports nothing."""

    def __post_init__(self) -> None:
        if self.budget_mb is not None:
            check_size_mb("budget_mb", self.budget_mb)
        if not isinstance(self.overwrite, bool):
            raise ValueError(f"overwrite must be a bool, got {self.overwrite!r}")
        object.__setattr__(self, "safe_globals", checked_safe_globals(self.safe_globals))
        if not isinstance(self.threads, int) or isinstance(self.threads, bool) or self.threads < 1:
            raise ValueError(f"threads must be a positive int, got {self.threads!r}")
        if self.progress is not None and not callable(self.progress):
            raise ValueError(f"progress must be a function or None, got {self.progress!r}")

    @property
    def budget_bytes(self) -> int:
        """:attr:`budget_mb` in bytes, as an export with the environment's I/O options
        reads (:meth:`budget`)."""
        return self.budget(IOOptions())

    def budget(self, io: IOOptions) -> int:
        """The bytes of blocks a rank holds, reading with ``io``
        (:meth:`~torchrec_cnr.IOOptions.read_budget`)."""
        budget = io.read_budget(self.budget_mb, BUDGET_MB)
        assert budget is not None  # BUDGET_MB at the least
        return budget


@dataclass
class DcpExport:
    """What one rank exported."""

    step: int
    blocks: int = 0
    bytes: int = 0
    tables: int = 0
    keys: list[str] = field(default_factory=list)
    """Every key of the checkpoint (all ranks')."""


def terminal_progress(rank: int) -> Progress:
    """Shows ``blocks done / blocks`` of this rank (:func:`progress_line`)."""

    def show(done: int, total: int) -> None:
        progress_line(f"[rank {rank}] dcp export: {done}/{total} blocks", done == total)

    return show


def _column_split(chain: ChainReader, table: str) -> list[tuple[int, int]]:
    """``(col_offset, cols)`` of the table's column shards, as the checkpoint last saved it."""
    last = [rec for rec in chain.link_records(-1) if rec.spec.table == table]
    recs: Iterable[ShardRecord] = last or (rec for _, rec in chain.records(table))
    return sorted({(r.spec.col_offset, r.spec.cols) for r in recs})


def _states(chain: ChainReader, table: str) -> dict[str, str]:
    """The table's optimizer states, by FBGEMM name -> ``row`` or ``element``."""
    found: dict[str, str] = {}
    for _, rec in chain.records(table):
        for name, info in rec.states.items():
            found[name] = info.layout or "element"
    return found


def _mapped(item: ReadItem, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    return mapped(shape, dtype)


@dataclass
class _Reads:
    """Reads each tensor of a block once, when the writer asks for it."""

    chain: ChainReader
    progress: Progress | None
    total: int = 0
    done: int = 0

    def __call__(self, dst: ShardSpec, name: str) -> torch.Tensor:
        value = table_block(self.chain, dst, (name,), alloc=_mapped).get(name)
        if value is None:  # a state no saved shard of this block holds
            value = torch.zeros((dst.rows, dst.cols) if name == "weight" else (dst.rows,))
        self.done += 1
        if self.progress is not None:
            self.progress(self.done, self.total)
        return value


def _table_blocks(
    chain: ChainReader, table: str, shape: TableShape, budget_bytes: int, read: _Reads
) -> list[list[Block]]:
    """The blocks of one table: for each piece of rows of each column shard, its weight
    block and its states' blocks (read together, by one rank)."""
    key = shape.state_dict_key
    if not key:
        raise ValueError(
            f"table {table!r}: the checkpoint does not record its state-dict key "
            "(written before format 3); it cannot be exported"
        )
    n, dim = shape.num_embeddings, shape.embedding_dim
    split, states = _column_split(chain, table), _states(chain, table)
    groups = []
    for j, (c0, cols) in enumerate(split):
        row_bytes = 4 * cols * (1 + sum(v == "element" for v in states.values())) + 4 * len(states)
        step = MemoryBudget(budget_bytes).rows(row_bytes)
        for r0 in range(0, n, step):
            rows = min(step, n - r0)
            dst = ShardSpec(table, 0, "export", r0, c0, rows, cols, n, dim, key)
            weight = partial(read, dst, "weight")
            group = [Block((MODEL, key), (r0, c0), (rows, cols), (n, dim), weight, owned=True)]
            for name, layout in sorted(states.items()):
                path = (OPTIM, *fused_state_path(key, table, name))
                load = partial(read, dst, name)
                if layout == "element":
                    group.append(Block(path, (r0, c0), (rows, cols), (n, dim), load, owned=True))
                elif len(split) == 1:
                    group.append(Block(path, (r0,), (rows,), (n,), load, owned=True))
                else:
                    at, size = (j * n + r0,), (len(split) * n,)
                    group.append(Block(path, at, (rows,), size, load, owned=True))
            groups.append(group)
    return groups


def _share(groups: list[list[Block]], rank: int, world: int) -> list[list[Block]]:
    """This rank's groups of blocks: each dealt to the rank with the fewest bytes so far."""
    load = [0] * world
    mine: list[list[Block]] = []
    for group in groups:
        size = sum(4 * int(torch.Size(b.sizes).numel()) for b in group)
        to = min(range(world), key=lambda r: (load[r], r))
        load[to] += size
        if to == rank:
            mine.append(group)
    return mine


def _draft(target: Path) -> Path:
    """Where an export to ``target`` is written before it takes that name: a hidden folder
    beside it, on its file system. A mount point (or ``.``) is written in place."""
    if target.name in ("", ".", "..") or os.path.ismount(target):
        return target
    return target.with_name(f".{target.name}.partial")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _prepare(target: Path, overwrite: bool) -> None:
    """Refuses a ``target`` that holds anything, unless ``overwrite``; makes the export's
    draft folder, empty (a killed export's is removed)."""
    if target.exists() and (not target.is_dir() or any(target.iterdir())) and not overwrite:
        raise FileExistsError(
            f"{target} exists; ExportOptions(overwrite=True) (cnr: --overwrite) replaces it"
        )
    draft = _draft(target)
    if draft == target:
        for child in target.iterdir():
            _remove(child)
        return
    _remove(draft)
    draft.mkdir(parents=True)


def _publish(target: Path) -> None:
    """The written export takes ``target``'s name; what held it before is removed only
    then, so that an export that fails leaves it as it was."""
    draft = _draft(target)
    if draft == target:
        return
    old = target.with_name(f".{target.name}.old")
    _remove(old)
    if target.exists() or target.is_symlink():
        os.rename(target, old)
    os.rename(draft, target)
    fsync_dir(target.parent)
    _remove(old)


def _discard(target: Path) -> None:
    """What a failed export wrote."""
    draft = _draft(target)
    for path in list(draft.iterdir()) if draft == target else [draft]:
        with contextlib.suppress(OSError):
            _remove(path)


def _objects(chain: ChainReader, options: ExportOptions) -> dict[str, Any]:
    """Rank 0's part: the dense state and its ``app_state`` objects."""
    allowed = resolve_globals(options.safe_globals)
    app = load_object(chain.app_state(0), allowed, "app_state of rank 0")
    clash = {MODEL, OPTIM} & set(app)
    if clash:
        raise ValueError(f"app_state names {sorted(clash)} clash with DCP's recipe keys")
    return {MODEL: chain.dense(), **app}


def _blocks_budget(
    chain: ChainReader, options: ExportOptions, ranks: Collective | None
) -> tuple[MemoryBudget, int]:
    """The export's memory, held in the process's ledger of reads while the caller keeps
    it: its budget, within what the process's other reads leave of it (the least such share
    over ``ranks``: one layout of blocks on every rank); and the most bytes of one block,
    that share halved for one writer thread (the next block is read while one is written)."""
    memory = MemoryBudget(options.budget(chain.io.options))
    share = memory.share()
    assert share is not None
    if ranks is not None:
        share = min(ranks.gather(share))
        memory.release()
        memory.take(share, always=True)
    return memory, share // (2 if options.threads == 1 else 1)


def export_dcp(
    root: Root,
    out: str | Path,
    step: int | None = None,
    options: ExportOptions | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    io: IOContext | IOOptions | None = None,
) -> DcpExport:
    """Writes the committed checkpoint of ``step`` (the latest if ``None``) as a DCP
    checkpoint at ``out`` that stock ``dcp.load`` reads into a TorchRec model (see the
    module's docstring for the keys).

    The options say how the export runs; ``group`` and ``io`` are what it runs on (who
    takes part, and the I/O threads it reads with), as in the library's other readers.

    Args:
        root: the checkpoint root: a path, an ``s3://bucket/prefix`` URL or a ``Storage``.
        out: the DCP checkpoint's directory (a local or shared file system).
        step: the committed step; the latest if ``None``.
        options: the block budget in MB, ``overwrite``, ``safe_globals``, the writer
            threads and the progress callback (:class:`ExportOptions`); the defaults if
            ``None``.
        group: with a process group, every rank of it calls this and writes its share of
            the blocks in parallel (collective); ``None``: this process writes all, with or
            without a process group.
        io: the I/O context to read on, or options for one of its own.

    Raises:
        FileExistsError: ``out`` exists and ``options.overwrite`` is False (nothing written).
        ValueError: no such step, ``options`` not an :class:`ExportOptions`, or an
            ``app_state`` named ``model`` or ``optim``.
        UnsafeObjectError: ``app_state`` holds a type not in ``options.safe_globals``.
        OSError: the export could not be written (``ENOSPC``, saying so, where the disk is
            full); ``out`` is as it was.

    Example::

        export_dcp("/ckpt/run1", "/ckpt/dcp_out", step=500)
        export_dcp(root, out, options=ExportOptions(budget_mb=64), group=dist.group.WORLD)
    """
    options = ExportOptions() if options is None else options
    if not isinstance(options, ExportOptions):
        raise ValueError(f"options must be an ExportOptions or None, got {options!r}")
    ranks = Collective(group) if group is not None else None
    rank, world = (ranks.rank, ranks.world_size) if ranks is not None else (0, 1)
    target = Path(out).resolve() if Path(out).is_symlink() else Path(out)  # a link: its folder

    def everywhere(fn: Callable[[], T]) -> T:
        """``fn()``, raising on every rank if it failed on any (none waits in DCP's save)."""
        return fn() if ranks is None else ranks.agree_on(fn)

    def on_rank0(fn: Callable[[], None]) -> None:
        """``fn()`` by rank 0 alone, its failure raised on every rank."""
        if ranks is None:
            fn()
        else:
            ranks.on_rank0(fn)

    on_rank0(partial(_prepare, target, options.overwrite))
    try:
        with everywhere(lambda: ChainReader.open(root, step, io=io)) as chain:
            read = _Reads(chain, options.progress)
            tables = chain.entry.tables
            memory, block_bytes = _blocks_budget(chain, options, ranks)
            groups = everywhere(
                lambda: [
                    g
                    for name in sorted(tables)
                    for g in _table_blocks(chain, name, tables[name], block_bytes, read)
                ]
            )
            mine = _share(groups, rank, world)
            read.total = sum(map(len, mine))
            saved = everywhere(lambda: _objects(chain, options) if rank == 0 else {})
            write_blocks(_draft(target), mine, saved, group, options.threads)
            memory.release()
            exported = chain.entry.step
        on_rank0(partial(_publish, target))
    except BaseException:
        if rank == 0:
            _discard(target)
        raise
    keys = sorted({b.fqn for g in groups for b in g})
    nbytes = sum(4 * int(torch.Size(b.sizes).numel()) for g in mine for b in g)
    return DcpExport(exported, read.total, nbytes, len(tables), keys)
