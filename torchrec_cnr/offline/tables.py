"""Reading a committed checkpoint without a process group or a model.

A table is assembled from its saved shards, baseline first and later checkpoints of the
chain winning, one saved shard at a time: memory is the table itself plus one shard.
Quantized rows come back dequantized, exactly as a restore gives them.

Example::

    weights = torchrec_cnr.read_table("/ckpt/run1", "t_user")           # (num_rows, dim)
    some = torchrec_cnr.read_table("s3://bucket/run1", "t_user", step=500, rows=[3, 17])
    state = torchrec_cnr.read_optimizer_state("/ckpt/run1", "t_user")   # {"momentum1": ...}
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import partial

import torch

from torchrec_cnr.commit.manifest import Entry, Manifest, TableShape
from torchrec_cnr.encoding import ShardRecord, decode_weight
from torchrec_cnr.storage import SnapshotReader, Storage, as_storage

__all__ = ["ChainReader", "read_optimizer_state", "read_table"]

Root = Storage | str | os.PathLike[str]


class ChainReader:
    """One committed checkpoint of a root, read without a model.

    Args:
        root: the checkpoint root: a path, an ``s3://`` URL or a :class:`Storage`.
        step: the committed step; the latest if ``None``.
        verify: check every tensor read whole against its checksum.

    Raises:
        ValueError: no committed checkpoint has ``step`` (or the root has none).
        ManifestError: the manifest is damaged.
        CheckpointReadError: a checkpoint of the chain is missing.
    """

    def __init__(self, root: Root, step: int | None = None, verify: bool = True) -> None:
        self.storage = as_storage(root)
        self.manifest = Manifest.load(self.storage)
        entry = self.manifest.find(step)
        if entry is None:
            raise ValueError(
                f"no committed checkpoint of step {step} in {self.storage.url}; "
                f"committed steps: {self.manifest.steps()}"
            )
        self.entry: Entry = entry
        self.chain = [self.manifest.by_id(i) for i in entry.chain]
        self.verify = verify
        self.readers = [
            SnapshotReader(self.storage, e.id, e.checksums_by_path() if verify else None)
            for e in self.chain
        ]

    @property
    def tables(self) -> dict[str, TableShape]:
        """Every table (qualified name) and its shape."""
        return dict(self.entry.tables)

    def table_name(self, table: str) -> str:
        """The qualified name of ``table``, given by its qualified or short name.

        Raises:
            ValueError: no such table, or a short name that several tables share.
        """
        if table in self.entry.tables:
            return table
        found = [t for t in self.entry.tables if t.rsplit(".", 1)[-1] == table]
        if len(found) != 1:
            raise ValueError(
                f"table {table!r} is {'ambiguous' if found else 'not in the checkpoint'}; "
                f"tables: {sorted(self.entry.tables)}"
            )
        return found[0]

    def _records(self, table: str) -> list[tuple[int, ShardRecord]]:
        return [(n, r) for n, e in enumerate(self.chain) for r in e.shards if r.spec.table == table]

    def saved_ids(self, n: int, rec: ShardRecord) -> torch.Tensor:
        """Global ids of the rows ``rec`` (of the chain's ``n``-th checkpoint) saved, in order."""
        ss = rec.spec
        if rec.all_rows:
            return torch.arange(ss.row_offset, ss.row_offset + ss.rows)
        return self.readers[n].rows(ss.rank, f"{rec.key}.ids").to(torch.int64)

    def _rows(
        self, rec: ShardRecord, n: int, wanted: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Global ids of the saved rows of ``rec`` to use, their positions in the saved
        tensors (``None``: all), and their positions in the output."""
        ids = self.saved_ids(n, rec)
        if wanted is None:
            return ids, None, ids
        if not wanted.numel():
            return ids[:0], ids[:0], ids[:0]
        pos = torch.searchsorted(wanted, ids).clamp_max(wanted.numel() - 1)
        keep = torch.nonzero(wanted[pos] == ids).flatten()
        return ids[keep], keep, pos[keep]

    def _read(self, n: int, rec: ShardRecord, name: str, keep: torch.Tensor | None) -> torch.Tensor:
        reader = self.readers[n]
        if keep is None:
            return reader.rows(rec.spec.rank, name)
        if self.verify:
            return reader.rows(rec.spec.rank, name)[keep]
        return reader.rows_subset(rec.spec.rank, name, keep)

    def _wanted(
        self, rows: Sequence[int] | torch.Tensor | None, shape: TableShape
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The distinct requested rows, ascending, and where each requested row is among
        them; ``(None, None)`` for every row."""
        if rows is None:
            return None, None
        wanted = torch.as_tensor(rows, dtype=torch.int64).flatten()
        bad = wanted[(wanted < 0) | (wanted >= shape.num_embeddings)]
        if bad.numel():
            raise ValueError(f"rows {bad[:5].tolist()} are outside 0..{shape.num_embeddings - 1}")
        unique, order = torch.unique(wanted, return_inverse=True)
        return unique, order

    def table(self, table: str, rows: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
        """The ``(num_rows, dim)`` fp32 values of ``table``, or ``(len(rows), dim)`` of the
        given global rows, in the order given."""
        name = self.table_name(table)
        shape = self.entry.tables[name]
        wanted, order = self._wanted(rows, shape)
        out = torch.zeros(
            shape.num_embeddings if wanted is None else wanted.numel(), shape.embedding_dim
        )
        for n, rec in self._records(name):
            if rec.saved_rows == 0:
                continue
            ids, keep, at = self._rows(rec, n, wanted)
            if not ids.numel():
                continue
            values = decode_weight(partial(self._read, n, rec, keep=keep), rec)
            cols = slice(rec.spec.col_offset, rec.spec.col_offset + rec.spec.cols)
            out[at, cols] = values.to(torch.float32)
        return out if order is None else out[order]

    def states(
        self, table: str, rows: Sequence[int] | torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """The fused optimizer state of ``table`` by FBGEMM name, as fp32.

        Per-element states are ``(num_rows, dim)``; a per-row state is ``(num_rows,)``,
        taken from the shards that hold the table's first column (as a restore does);
        the kernels' step counters are 0-d tensors. ``rows`` selects global rows as in
        :meth:`table`.
        """
        name = self.table_name(table)
        shape = self.entry.tables[name]
        wanted, order = self._wanted(rows, shape)
        n_out = shape.num_embeddings if wanted is None else wanted.numel()
        out: dict[str, torch.Tensor] = {}
        for n, rec in self._records(name):
            for key, value in rec.scalars.items():
                out[key] = torch.tensor(value)  # the last checkpoint's count wins
            first_col = rec.spec.col_offset == 0
            if rec.saved_rows == 0 or not rec.states:
                continue
            ids, keep, at = self._rows(rec, n, wanted)
            if not ids.numel():
                continue
            cols = slice(rec.spec.col_offset, rec.spec.col_offset + rec.spec.cols)
            for state, info in rec.states.items():
                saved = self._read(n, rec, info.tensor, keep).to(torch.float32)
                if saved.dim() == 2:
                    dst = out.setdefault(state, torch.zeros(n_out, shape.embedding_dim))
                    dst[at, cols] = saved
                elif first_col:
                    out.setdefault(state, torch.zeros(n_out))[at] = saved
        if order is not None:
            out = {k: v[order] if v.dim() else v for k, v in out.items()}
        return out

    def dense(self) -> dict[str, torch.Tensor]:
        """The dense state (parameters, buffers, data-parallel tables) of the checkpoint."""
        return {name: self.readers[-1].dense(name) for name in self.entry.dense}


def read_table(
    root: Root,
    table: str,
    step: int | None = None,
    rows: Sequence[int] | torch.Tensor | None = None,
    verify: bool = True,
) -> torch.Tensor:
    """The ``(num_rows, dim)`` fp32 values of one table at a committed step, without a model.

    Args:
        root: the checkpoint root: a path, an ``s3://bucket/prefix`` URL or a ``Storage``.
        table: the table's qualified name (``sparse.ebc.t_user``) or short name (``t_user``).
        step: the committed step; the latest if ``None``.
        rows: global rows to read; the result is then ``(len(rows), dim)``, in that order.
        verify: check every tensor against its checksum. With ``rows`` and ``verify=False``
            only the requested rows' bytes are read.

    Raises:
        ValueError: no such step or table, or a row outside the table.
        ChecksumError: a stored tensor is damaged.
    """
    return ChainReader(root, step, verify).table(table, rows)


def read_optimizer_state(
    root: Root,
    table: str,
    step: int | None = None,
    rows: Sequence[int] | torch.Tensor | None = None,
    verify: bool = True,
) -> dict[str, torch.Tensor]:
    """The fused optimizer state of one table at a committed step, without a model.

    See :meth:`ChainReader.states` for the shapes and :func:`read_table` for the arguments.
    """
    return ChainReader(root, step, verify).states(table, rows)
