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

Every table is written in blocks of at most ``budget_bytes``, each read from the chain
only when DCP's writer reaches it. Under ``torchrun`` every rank writes its share of the
blocks into its own files in parallel; rank 0 writes the metadata.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from torchrec_cnr.collectives import Collective
from torchrec_cnr.interop.dcp_io import Block, fused_state_path, write_blocks
from torchrec_cnr.iocontext import IOContext, IOOptions
from torchrec_cnr.read.chain import ChainReader
from torchrec_cnr.read.tables import table_block
from torchrec_cnr.schema import ShardRecord, TableShape
from torchrec_cnr.snapshot.objects import load_object, resolve_globals
from torchrec_cnr.storage import Root
from torchrec_cnr.tracking.shard import ShardSpec

__all__ = ["DcpExport", "export_dcp", "terminal_progress"]

MODEL, OPTIM = "model", "optim"
"""The top-level keys of TorchRec's DCP recipe."""

T = TypeVar("T")

Progress = Callable[[int, int], None]
"""Called after each block a rank writes, with its blocks done and its blocks in all."""


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
    """Prints ``blocks done / blocks`` of this rank on one line of stderr."""

    def show(done: int, total: int) -> None:
        end = "\n" if done == total else ""
        print(f"\r[rank {rank}] dcp export: {done}/{total} blocks", end=end, file=sys.stderr)

    return show


def _column_split(chain: ChainReader, table: str) -> list[tuple[int, int]]:
    """``(col_offset, cols)`` of the table's column shards, as the checkpoint last saved it."""
    last = [rec for rec in chain.entry.shards if rec.spec.table == table]
    recs: Iterable[ShardRecord] = last or (rec for _, rec in chain.records(table))
    return sorted({(r.spec.col_offset, r.spec.cols) for r in recs})


def _states(chain: ChainReader, table: str) -> dict[str, str]:
    """The table's optimizer states, by FBGEMM name -> ``row`` or ``element``."""
    found: dict[str, str] = {}
    for _, rec in chain.records(table):
        for name, info in rec.states.items():
            found[name] = info.layout or "element"
    return found


@dataclass
class _Reads:
    """Reads each tensor of a block once, when the writer asks for it."""

    chain: ChainReader
    progress: Progress | None
    total: int = 0
    done: int = 0

    def __call__(self, dst: ShardSpec, name: str) -> torch.Tensor:
        value = table_block(self.chain, dst, (name,)).get(name)
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
        step = max(1, budget_bytes // row_bytes)
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


def _share(groups: list[list[Block]], rank: int, world: int) -> list[Block]:
    """This rank's blocks: groups dealt to the rank with the fewest bytes so far."""
    load = [0] * world
    mine: list[Block] = []
    for group in groups:
        size = sum(4 * int(torch.Size(b.sizes).numel()) for b in group)
        to = min(range(world), key=lambda r: (load[r], r))
        load[to] += size
        if to == rank:
            mine.extend(group)
    return mine


def export_dcp(
    root: Root,
    out: str | Path,
    step: int | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    budget_bytes: int = 256 << 20,
    overwrite: bool = False,
    safe_globals: Collection[str | type] = (),
    progress: Progress | None = None,
    io: IOContext | IOOptions | None = None,
    threads: int = 1,
) -> DcpExport:
    """Writes the committed checkpoint of ``step`` (the latest if ``None``) as a DCP
    checkpoint at ``out`` that stock ``dcp.load`` reads into a TorchRec model (see the
    module's docstring for the keys).

    Args:
        root: the checkpoint root: a path, an ``s3://bucket/prefix`` URL or a ``Storage``.
        out: the DCP checkpoint's directory (a local or shared file system).
        step: the committed step; the latest if ``None``.
        group: with a process group, every rank of it calls this and writes its share of
            the blocks in parallel (collective); ``None``: this process writes all, with or
            without a process group.
        budget_bytes: the most a block holds (a table's rows and their states); a rank
            holds one block at a time.
        overwrite: replace ``out`` if it exists.
        safe_globals: types ``app_state`` may hold beyond the built-in ones (as
            ``CheckpointConfig.safe_globals``).
        progress: called after each block this rank writes.
        io: the I/O context to read on, or options for one of its own.
        threads: DCP's writer threads per rank, each writing its own file (and holding
            its own block).

    Raises:
        FileExistsError: ``out`` exists and ``overwrite`` is False (nothing written).
        ValueError: no such step, a bad budget, or an ``app_state`` named ``model`` or
            ``optim``.
        UnsafeObjectError: ``app_state`` holds a type not in ``safe_globals``.
    """
    if budget_bytes < 1024:
        raise ValueError(f"budget_bytes must be at least 1024, got {budget_bytes}")
    ranks = Collective(group) if group is not None else None
    rank, world = (ranks.rank, ranks.world_size) if ranks is not None else (0, 1)
    target = Path(out)

    def everywhere(fn: Callable[[], T]) -> T:
        """``fn()``, raising on every rank if it failed on any (none waits in DCP's save)."""
        return fn() if ranks is None else ranks.agree_on(fn)

    def prepare() -> None:
        if target.exists() and (not target.is_dir() or any(target.iterdir())):
            if not overwrite:
                raise FileExistsError(f"{target} exists; pass overwrite=True to replace it")
            if target.is_dir():
                shutil.rmtree(target)
            else:
                target.unlink()
        target.mkdir(parents=True, exist_ok=True)

    def objects(chain: ChainReader) -> dict[str, Any]:
        """Rank 0's: the dense state and its ``app_state`` objects."""
        if rank != 0:
            return {}
        allowed = resolve_globals(safe_globals)
        app = load_object(chain.app_state(0), allowed, "app_state of rank 0")
        clash = {MODEL, OPTIM} & set(app)
        if clash:
            raise ValueError(f"app_state names {sorted(clash)} clash with DCP's recipe keys")
        return {MODEL: chain.dense(), **app}

    if ranks is None:
        prepare()
    else:
        ranks.on_rank0(prepare)
    with everywhere(lambda: ChainReader.open(root, step, io=io)) as chain:
        read = _Reads(chain, progress)
        tables = chain.entry.tables
        groups = everywhere(
            lambda: [
                g
                for name in sorted(tables)
                for g in _table_blocks(chain, name, tables[name], budget_bytes, read)
            ]
        )
        mine = _share(groups, rank, world)
        read.total = len(mine)
        saved = everywhere(lambda: objects(chain))
        write_blocks(target, mine, saved, group, threads)
        keys = sorted({b.fqn for g in groups for b in g})
        nbytes = sum(4 * int(torch.Size(b.sizes).numel()) for b in mine)
        return DcpExport(chain.entry.step, len(mine), nbytes, len(tables), keys)
