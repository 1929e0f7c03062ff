"""Exporting a committed checkpoint as the state dict of the *unsharded* model.

The keys are those the unsharded module's ``state_dict()`` uses: each table under the key
its EmbeddingBagCollection or EmbeddingCollection gives it
(``sparse.ebc.embedding_bags.t0.weight``), the dense state under its own keys
(``over.weight``). So ``unsharded_model.load_state_dict(export_state_dict(root))`` just
works, on one GPU or CPU, for inference, publishing or transfer learning.

Example::

    model = TestSparseNN(tables=tables, weighted_tables=weighted)   # unsharded
    model.load_state_dict(torchrec_cnr.export_state_dict("/ckpt/run1"))

    # or from the command line, in a format other tools read:
    #   cnr export /ckpt/run1 --out model.safetensors --format safetensors
    # and as a DCP checkpoint a job resumes from with stock dcp.load: export_dcp()
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import torch

from torchrec_cnr.iocontext import IOContext, IOOptions
from torchrec_cnr.read.chain import ChainReader
from torchrec_cnr.read.tables import table_name, table_values
from torchrec_cnr.storage import Root
from torchrec_cnr.storage.fs import out_of_space, replacing

__all__ = ["EXPORT_FORMATS", "ExportFormat", "export_state_dict", "save_export"]

ExportFormat = Literal["torch", "safetensors"]
EXPORT_FORMATS: tuple[ExportFormat, ...] = ("torch", "safetensors")
"""Single-file formats of the unsharded state dict; a resumable DCP checkpoint is
:func:`torchrec_cnr.export_dcp`'s."""

Progress = Callable[[str, int, int], None]
"""Called after each table with its key, how many tables are done, and how many in all."""


def export_state_dict(
    root: Root,
    step: int | None = None,
    tables: Sequence[str] | None = None,
    progress: Progress | None = None,
    io: IOContext | IOOptions | None = None,
) -> dict[str, torch.Tensor]:
    """The unsharded model's state dict at a committed step.

    Args:
        root: the checkpoint root: a path, an ``s3://bucket/prefix`` URL or a ``Storage``.
        step: the committed step; the latest if ``None``.
        tables: only these tables (qualified or short names), and no dense state;
            every table and the dense state if ``None``.
        progress: called after each table is read.
        io: the I/O context to read on, or options for one of its own.

    Raises:
        ValueError: no such step or table, or a checkpoint written before its format
            recorded the tables' state-dict keys (format 3).
    """
    with ChainReader.open(root, step, io=io) as chain:
        tables_of = chain.entry.tables
        names = [table_name(chain, t) for t in tables] if tables is not None else sorted(tables_of)
        out: dict[str, torch.Tensor] = {}
        for done, name in enumerate(names, 1):
            key = tables_of[name].state_dict_key
            if not key:
                raise ValueError(
                    f"table {name!r}: the checkpoint does not record its state-dict key "
                    "(written before format 3); read it with read_table() instead"
                )
            out[key] = table_values(chain, name)
            if progress is not None:
                progress(key, done, len(names))
        if tables is None:
            out.update(chain.dense())
    return out


def save_export(
    state_dict: dict[str, torch.Tensor], out: str | os.PathLike[str], fmt: ExportFormat = "torch"
) -> None:
    """Writes an exported state dict.

    ``torch`` writes one ``torch.save`` file; ``safetensors`` one safetensors file
    (needs the ``safetensors`` package). The file is written beside ``out`` and renamed
    to it once whole and durable: ``out`` is never seen half written, and a write that
    fails leaves it as it was.

    Raises:
        ValueError: an unknown format.
        OSError: the file could not be written (``ENOSPC``, saying so, where the disk is
            full).
    """
    if fmt not in EXPORT_FORMATS:
        raise ValueError(f"format must be one of {EXPORT_FORMATS}, got {fmt!r}")
    path = Path(out).resolve() if Path(out).is_symlink() else Path(out)  # a link: its file
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written beside it, then renamed: a failed write (a full disk) leaves ``out`` as it was.
    with replacing(path) as draft, out_of_space(path, f"the export {path}"):
        if fmt == "torch":
            torch.save(state_dict, draft)
        else:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in state_dict.items()}, str(draft))
            # safetensors creates it owner-only (0600); as any other file, it follows the
            # umask.
            mask = os.umask(0)
            os.umask(mask)
            draft.chmod(0o666 & ~mask)


def progress_line(text: str, last: bool) -> None:
    """Shows a progress line on stderr: rewritten in place on a terminal, a line of its own
    where stderr goes to a file or a pipe (a log), so that the lines do not run together."""
    if sys.stderr.isatty():
        print(f"\r{text}", end="\n" if last else "", file=sys.stderr, flush=True)
    else:
        print(text, file=sys.stderr, flush=True)
