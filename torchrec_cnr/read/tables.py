"""Reading a committed checkpoint's tables without a process group or a model.

A table is assembled from its saved shards, baseline first and later links of the chain
winning, one saved shard at a time (:mod:`torchrec_cnr.read.geometry` says where each
row lands): memory is the table itself plus one shard. Each saved shard is read as a
plan (:mod:`torchrec_cnr.read.plan`): for a block of a table's rows (the DCP export
writes tables in blocks), of a saved shard only partly in it only the stored rows that
land. Quantized rows come back dequantized, exactly as a restore gives them.

Example::

    weights = torchrec_cnr.read_table("/ckpt/run1", "t_user")           # (num_rows, dim)
    some = torchrec_cnr.read_table("s3://bucket/run1", "t_user", step=500, rows=[3, 17])
    state = torchrec_cnr.read_optimizer_state("/ckpt/run1", "t_user")   # {"momentum1": ...}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from functools import partial

import torch

from torchrec_cnr.encoding import ShardRecord, decode_weight
from torchrec_cnr.iocontext import IOContext, IOOptions
from torchrec_cnr.read.chain import ChainReader
from torchrec_cnr.read.geometry import Placement, place, scatter, slot, whole_table
from torchrec_cnr.read.items import Alloc, MemoryBudget, ReadItem, ReadPlan
from torchrec_cnr.read.plan import carry_out
from torchrec_cnr.storage import Root
from torchrec_cnr.tracking.shard import ShardSpec

__all__ = [
    "read_optimizer_state",
    "read_table",
    "table_block",
    "table_name",
    "table_states",
    "table_values",
]

Rows = Sequence[int] | torch.Tensor


def table_name(chain: ChainReader, table: str) -> str:
    """The qualified name of ``table``, given by its qualified or short name.

    Raises:
        ValueError: no such table, or a short name that several tables share.
    """
    tables = chain.entry.tables
    if table in tables:
        return table
    found = [t for t in tables if t.rsplit(".", 1)[-1] == table]
    if len(found) != 1:
        raise ValueError(
            f"table {table!r} is {'ambiguous' if found else 'not in the checkpoint'}; "
            f"tables: {sorted(tables)}"
        )
    return found[0]


def _destination(
    chain: ChainReader, table: str, rows: Rows | None
) -> tuple[str, ShardSpec, torch.Tensor | None, torch.Tensor | None]:
    """The table's name, the whole table as a destination, the distinct requested rows
    (ascending) and where each requested row is among them (``None`` for every row)."""
    name = table_name(chain, table)
    shape = chain.entry.tables[name]
    dst = whole_table(name, shape.num_embeddings, shape.embedding_dim)
    if rows is None:
        return name, dst, None, None
    wanted = torch.as_tensor(rows, dtype=torch.int64).flatten()
    bad = wanted[(wanted < 0) | (wanted >= shape.num_embeddings)]
    if bad.numel():
        raise ValueError(f"rows {bad[:5].tolist()} are outside 0..{shape.num_embeddings - 1}")
    unique, order = torch.unique(wanted, return_inverse=True)
    return name, dst, unique, order


def table_values(chain: ChainReader, table: str, rows: Rows | None = None) -> torch.Tensor:
    """The ``(num_rows, dim)`` fp32 values of ``table``, or ``(len(rows), dim)`` of the
    given global rows, in the order given."""
    _, dst, wanted, order = _destination(chain, table, rows)
    values = table_block(chain, dst, ("weight",), wanted).get("weight")
    if values is None:  # no saved row
        values = torch.zeros(dst.rows if wanted is None else wanted.numel(), dst.cols)
    return values if order is None else values[order]


def table_states(
    chain: ChainReader, table: str, rows: Rows | None = None
) -> dict[str, torch.Tensor]:
    """The fused optimizer state of ``table`` by FBGEMM name, as fp32.

    Per-element states are ``(num_rows, dim)``; a per-row state is ``(num_rows,)``,
    taken from the shards that hold the table's first column (as a restore does); the
    kernels' step counters are 0-d tensors. ``rows`` selects global rows as in
    :func:`table_values`.
    """
    name, dst, wanted, order = _destination(chain, table, rows)
    out: dict[str, torch.Tensor] = {}
    states: set[str] = set()
    for link in chain.links:
        for rec in chain.manifest.shards(link):
            if rec.spec.table == name:
                out.update({k: torch.tensor(v) for k, v in rec.scalars.items()})  # last wins
                states.update(rec.states)
    out.update(table_block(chain, dst, states, wanted))
    if order is not None:
        out = {k: v[order] if v.dim() else v for k, v in out.items()}
    return out


def table_block(
    chain: ChainReader,
    dst: ShardSpec,
    wanted: Collection[str] | None = None,
    rows: torch.Tensor | None = None,
    alloc: Alloc | None = None,
) -> dict[str, torch.Tensor]:
    """One block of a table, ``dst`` (``dst.table`` its qualified name), as a restore into
    a shard ``dst`` gives it: ``"weight"``, ``(rows, cols)`` fp32 values, and each fused
    optimizer state by FBGEMM name, per element ``(rows, cols)`` or per row ``(rows,)``
    from the saved shards holding ``dst``'s first column. ``wanted``: only these of them.
    ``rows``: only these ascending global rows of ``dst``, in that order. One saved shard
    at a time, of each only the stored rows from the first that lands in ``dst`` to the
    last are read (in the checksummed blocks they lie in; the whole tensor in roots written
    before block checksums); with ``rows`` and without checksum verification, only the
    rows that land. ``alloc`` gives what a stored tensor read whole is read into (a
    saved shard that is the block itself is given back in it). What no saved shard
    holds is left out."""
    n_out = dst.rows if rows is None else rows.numel()
    out: dict[str, torch.Tensor] = {}
    placed = [
        (n, rec, where)
        for n, rec in chain.records(dst.table)
        if wanted is None or "weight" in wanted or set(rec.states) & set(wanted)
        if (where := place(rec.spec, chain.saved_ids(n, rec), dst, rows)) is not None
    ]
    for n, rec, where in placed:
        if rows is None:
            reader, where = _read_saved(chain, n, rec, where, wanted, alloc)
            fetch = reader.fetch(n, rec)
        elif where.keep is None:
            fetch = chain.fetch(n, rec)
        else:
            fetch = partial(chain.subset, n, rec, keep=where.keep)
        # One saved shard that is the block itself, rows in order: no copy.
        whole = rows is None and len(placed) == 1 and _is_whole(where, rec.spec, dst)
        if _wants(wanted, "weight"):
            values = decode_weight(fetch, rec)
            if whole:
                out["weight"] = values
            else:
                scatter(slot(out, "weight", (n_out, dst.cols)), where, values)
        for state, info in rec.states.items():
            if not _wants(wanted, state):
                continue
            saved = fetch(info.tensor)
            if whole and saved.dtype == torch.float32:
                out[state] = saved
                continue
            shape = (n_out, dst.cols) if saved.dim() == 2 else (n_out,)
            scatter(slot(out, state, shape), where, saved)
    return out


def _wants(wanted: Collection[str] | None, name: str) -> bool:
    return wanted is None or name in wanted


def _read_saved(
    chain: ChainReader,
    n: int,
    rec: ShardRecord,
    where: Placement,
    wanted: Collection[str] | None,
    alloc: Alloc | None,
) -> tuple[ChainReader, Placement]:
    """Reads, as a plan, the stored tensors of saved shard ``rec`` (of link ``n``) that a
    block wants: whole where every saved row lands in it, else from the first that lands
    to the last (:attr:`Placement.window`). A reader holding them, and ``where`` counting
    the saved rows from the first read."""
    values = rec.value_names if _wants(wanted, "weight") else []
    names = values + [info.tensor for state, info in rec.states.items() if _wants(wanted, state)]
    window = where.window
    if window is not None and any((n, rec.spec.rank, m) in chain.held for m in names):
        window = None  # held whole already
    plan = ReadPlan((tuple(ReadItem.of(n, rec, name, window) for name in names),))
    reader = carry_out(chain, plan, MemoryBudget(None), alloc).chain
    if window is None:
        return reader, where
    assert where.keep is not None
    return reader, dataclasses.replace(where, keep=where.keep - window[0])


def _is_whole(where: Placement, src: ShardSpec, dst: ShardSpec) -> bool:
    """Whether the saved shard ``src`` holds exactly block ``dst``, its rows in order."""
    return (
        (src.row_offset, src.rows, src.col_offset, src.cols)
        == (dst.row_offset, dst.rows, dst.col_offset, dst.cols)
        and where.keep is None
        and where.count == dst.rows
        and bool((where.rows == torch.arange(dst.rows)).all())
    )


def read_table(
    root: Root,
    table: str,
    step: int | None = None,
    rows: Rows | None = None,
    verify: bool = True,
    io: IOContext | IOOptions | None = None,
) -> torch.Tensor:
    """The ``(num_rows, dim)`` fp32 values of one table at a committed step, without a model.

    Args:
        root: the checkpoint root: a path, an ``s3://bucket/prefix`` URL or a ``Storage``.
        table: the table's qualified name (``sparse.ebc.t_user``) or short name (``t_user``).
        step: the committed step; the latest if ``None``.
        rows: global rows to read; the result is then ``(len(rows), dim)``, in that order.
        verify: check every tensor against its checksum. With ``rows`` and ``verify=False``
            only the requested rows' bytes are read.
        io: the I/O context to read on, or options for one of its own.

    Raises:
        ValueError: no such step or table, or a row outside the table.
        ChecksumError: a stored tensor is damaged.
    """
    with ChainReader.open(root, step, verify, io) as chain:
        return table_values(chain, table, rows)


def read_optimizer_state(
    root: Root,
    table: str,
    step: int | None = None,
    rows: Rows | None = None,
    verify: bool = True,
    io: IOContext | IOOptions | None = None,
) -> dict[str, torch.Tensor]:
    """The fused optimizer state of one table at a committed step, without a model.

    See :func:`table_states` for the shapes and :func:`read_table` for the arguments.
    """
    with ChainReader.open(root, step, verify, io) as chain:
        return table_states(chain, table, rows)
