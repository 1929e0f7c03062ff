"""Reading and writing PyTorch DCP checkpoints a block at a time.

DCP (``torch.distributed.checkpoint``) stores each tensor as chunks, one per shard that
saved it, and any process can read any block of any tensor. These helpers read and write
blocks without a process group (or with one, to write in parallel), through DCP's own
planner interface and file-system storage, so the files are DCP's own:

- :class:`DcpReader` reads a checkpoint's metadata with an unpickler that runs no code,
  any block of a tensor, and the objects under a key, unpickled as a restore unpickles
  ``app_state`` (nothing but the types it is told to allow);
- :func:`write_blocks` writes tensors given as groups of blocks read on demand (memory:
  the group written and the next, read meanwhile; a block's memory takes the next block
  once it is written, and is kept for the next write when this one ends) and objects,
  under nested keys that ``dcp_to_torch_save`` rebuilds.
"""

from __future__ import annotations

import contextlib
import io
import math
import mmap
import pickle
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from itertools import accumulate
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import WriteResult

from torchrec_cnr.errors import CheckpointReadError, CnrError
from torchrec_cnr.snapshot.buffers import anonymous
from torchrec_cnr.snapshot.objects import load_object
from torchrec_cnr.storage import DIRECT_MIN_BYTES
from torchrec_cnr.storage.fs import out_of_space

__all__ = ["Block", "DcpReader", "fused_state_path", "mapped", "write_blocks"]

Path_ = tuple[str | int, ...]
"""A key's place in the nested state dict: ``("optim", "state", "t0.weight", "t0.momentum1")``."""


def fused_state_path(state_dict_key: str, table: str, state: str) -> tuple[str, str, str]:
    """Where TorchRec's ``fused_optimizer.state_dict()`` keeps a table's optimizer state:
    under ``state``, the table's key, then ``<table>.<state>`` (``t0.momentum1``)."""
    return ("state", state_dict_key, f"{table.rsplit('.', 1)[-1]}.{state}")


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata``: the types of DCP's metadata, torch sizes, dtypes and
    layouts, and plain containers. Any other global, and any function (a pickle can call
    one with arguments of its choosing), is refused before it runs."""

    _MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner")
    _NAMES = {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("pathlib", "PosixPath"),  # where the checkpoint was written (StorageMeta)
        ("pathlib", "PurePosixPath"),
    }
    _TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)

    def find_class(self, module: str, name: str) -> Any:
        if module in self._MODULES or (module, name) in self._NAMES:
            found = super().find_class(module, name)
            if isinstance(found, type):
                return found
        elif module == "torch.serialization" and name == "_get_layout":
            return _layout  # how torch pickles a layout: by its name
        elif module == "torch":
            value = getattr(torch, name, None)
            if name == "Size" or isinstance(value, self._TORCH_VALUES):
                return super().find_class(module, name)
        raise pickle.UnpicklingError(f"DCP metadata names {module}.{name}, which is not allowed")


def _layout(name: str) -> torch.layout:
    """``torch.strided`` from ``"torch.strided"``, and nothing but a layout."""
    value = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(value, torch.layout):
        raise pickle.UnpicklingError(f"DCP metadata names layout {name!r}, which is not one")
    return value


class DcpReader:
    """One DCP checkpoint directory, read without a process group.

    Raises:
        CheckpointReadError: no checkpoint there, or unreadable metadata.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self.storage = FileSystemReader(self.path)
        meta = Path(self.path) / ".metadata"
        try:
            with open(meta, "rb") as f:
                self.metadata: Metadata = _MetadataUnpickler(f).load()
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError) as e:
            raise CheckpointReadError(f"{meta}: not a readable DCP checkpoint ({e})") from e
        self.storage.read_metadata = lambda *a, **k: self.metadata  # type: ignore[method-assign]

    @property
    def keys(self) -> dict[str, TensorStorageMetadata | BytesStorageMetadata]:
        return self.metadata.state_dict_metadata

    def size(self, fqn: str) -> tuple[int, ...] | None:
        """The global shape of tensor ``fqn``; ``None`` if it is absent or not a tensor."""
        md = self.keys.get(fqn)
        return tuple(md.size) if isinstance(md, TensorStorageMetadata) else None

    def chunks(self, fqn: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """``(offsets, sizes)`` of every stored chunk of tensor ``fqn``, in offset order."""
        md = self.keys[fqn]
        assert isinstance(md, TensorStorageMetadata)
        return sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)

    def read(self, blocks: Iterable[tuple[str, tuple[int, ...], torch.Tensor]]) -> None:
        """Reads, for each ``(fqn, offsets, out)``, the block of tensor ``fqn`` at
        ``offsets`` of ``out``'s shape into ``out`` (any view; dtypes convert), one saved
        chunk at a time."""
        first: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        again: list[tuple[torch.Tensor, torch.Tensor]] = []  # one block wanted twice
        for fqn, offsets, out in blocks:
            seen = first.setdefault((fqn, tuple(offsets)), out)
            if seen is not out:
                again.append((out, seen))
        if first:
            self._load(_ReadBlocks([(f, o, t) for (f, o), t in first.items()]))
        for out, seen in again:
            out.copy_(seen)

    def objects(self, prefix: str, allowed: Iterable[Any]) -> Any:
        """The nested state dict saved under key ``prefix`` (tensors and objects), rebuilt
        as it was saved; objects unpickled running no code beyond ``allowed`` types.

        Raises:
            UnsafeObjectError: an object names a type not allowed.
        """
        planner = _ReadObjects(self, prefix, list(allowed))
        if planner.tensors or planner.bytes_keys:
            self._load(planner)
        return planner.tree

    def _load(self, planner: DefaultLoadPlanner) -> None:
        try:
            dcp.load({}, storage_reader=self.storage, planner=planner, no_dist=True)
        except CheckpointException as e:
            cause = _cause(e)
            if isinstance(cause, CnrError):
                raise cause from None
            raise CheckpointReadError(f"{self.path}: {type(cause).__name__}: {cause}") from cause


def _below(prefix: str, fqn: str, path: Iterable[str | int] | None) -> Path_:
    """The place of ``fqn`` in the state dict saved under ``prefix``: its saved path (DCP's
    planner data) less the components that spell ``prefix``."""
    full = tuple(path or ())
    for cut in range(1, len(full)):
        if ".".join(map(str, full[:cut])) == prefix:
            return full[cut:]
    return (fqn[len(prefix) + 1 :],)


def _cause(e: CheckpointException) -> BaseException:
    """The exception DCP wrapped (the lowest rank's)."""
    failures = e.failures
    return failures[min(failures)][0] if failures else e


class _ReadBlocks(DefaultLoadPlanner):
    """Reads blocks of tensors into given tensors; never unpickles."""

    def __init__(self, blocks: list[tuple[str, tuple[int, ...], torch.Tensor]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.blocks = {(fqn, torch.Size(offsets)): out for fqn, offsets, out in blocks}

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        items: list[ReadItem] = []
        for (fqn, offsets), out in self.blocks.items():
            md = self.metadata.state_dict_metadata[fqn]
            assert isinstance(md, TensorStorageMetadata)
            items += create_read_items_for_chunk_list(
                fqn, md, [ChunkStorageMetadata(offsets, out.shape)]
            )
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        assert index.offset is not None
        return self.blocks[(index.fqn, index.offset)]

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise AssertionError("block reads read no objects")


class _ReadObjects(_ReadBlocks):
    """Reads every key under a prefix whole, objects through :func:`load_object`."""

    def __init__(self, reader: DcpReader, prefix: str, allowed: list[Any]) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.bytes_keys: list[str] = []
        self.allowed = allowed
        self.tree: dict[str, Any] = {}
        self.paths: dict[str, Path_] = {}
        planner_data = reader.metadata.planner_data or {}
        for fqn, md in reader.keys.items():
            if not fqn.startswith(prefix + "."):
                continue
            self.paths[fqn] = _below(prefix, fqn, planner_data.get(fqn))
            if isinstance(md, TensorStorageMetadata):
                self.tensors[fqn] = torch.empty(md.size, dtype=md.properties.dtype)
                set_element(self.tree, self.paths[fqn], self.tensors[fqn])
            else:
                self.bytes_keys.append(fqn)
        super().__init__([(k, (0,) * t.dim(), t) for k, t in self.tensors.items()])

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        for fqn in self.bytes_keys:
            at = MetadataIndex(fqn)
            plan.items.append(
                ReadItem(
                    LoadItemType.BYTE_IO,
                    at,
                    torch.Size((0,)),
                    at,
                    torch.Size((0,)),
                    torch.Size((0,)),
                )  # fmt: skip
            )
        return plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        set_element(self.tree, self.paths[fqn], load_object(value.read(), self.allowed, fqn))


@dataclass(frozen=True)
class Block:
    """One chunk of a tensor to write, read when DCP's writer reaches it."""

    path: Path_
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    size: tuple[int, ...]
    """The whole tensor's shape."""
    load: Callable[[], torch.Tensor]
    dtype: torch.dtype = torch.float32
    owned: bool = False
    """``load`` returns memory of its own, which the writer frees once written."""

    @property
    def fqn(self) -> str:
        return ".".join(map(str, self.path))


class _ReadAhead:
    """Each group of blocks read while the group before it is written, on a thread of its
    own: DCP's writer with one thread asks for the blocks in their order, so when it
    reaches a group's first block the next group's reads begin (two groups in memory at
    most: the writer frees each block once it is written, see
    :meth:`_WriteBlocks.resolve_data`). The first group is read from the start."""

    def __init__(self, groups: Sequence[Sequence[Block]]) -> None:
        flat = [b for g in groups for b in g]
        self.loads = [b.load for b in flat]
        self.blocks = [replace(b, load=partial(self.take, i)) for i, b in enumerate(flat)]
        starts = [0, *accumulate(map(len, groups))]
        spans = [range(a, b) for a, b in zip(starts, starts[1:])]  # each group's blocks
        self.next_group = {span.start: after for span, after in zip(spans, spans[1:])}
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="cnr-read-ahead")
        first = spans[0] if spans else range(0)  # read while DCP plans
        self.ahead = {j: self.pool.submit(self.loads[j]) for j in first}

    def take(self, i: int) -> torch.Tensor:
        read = self.ahead.pop(i, None)
        for j in self.next_group.get(i, ()):
            self.ahead[j] = self.pool.submit(self.loads[j])
        return self.loads[i]() if read is None else read.result()

    def close(self) -> None:
        """Waits for a read still running (none outlives the write), dropping its block."""
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.ahead.clear()


def write_blocks(
    path: str | Path,
    blocks: Sequence[Sequence[Block]],
    objects: Mapping[str, Any] | None = None,
    group: dist.ProcessGroup | None = None,
    threads: int = 1,
) -> None:
    """Writes a DCP checkpoint of ``blocks``, in groups read together (a table's rows
    and their optimizer states), and ``objects`` (a nested state dict of plain values and
    tensors, flattened as ``dcp.save`` flattens one).

    With ``group``, every rank of it calls this with its own blocks (together they tile
    every tensor) and writes its own files; rank 0 writes the metadata. Without one, this
    process writes everything. With one writer thread, each group is read while the one
    before it is written (:class:`_ReadAhead`): two groups are in memory at once.
    """
    ahead = _ReadAhead(blocks) if threads == 1 else None
    try:
        flat = [b for g in blocks for b in g] if ahead is None else ahead.blocks
        _write_blocks(path, flat, objects, group, threads)
    finally:
        if ahead is not None:
            ahead.close()
        _keep_spare()


def _write_blocks(
    path: str | Path,
    blocks: list[Block],
    objects: Mapping[str, Any] | None,
    group: dist.ProcessGroup | None,
    threads: int,
) -> None:
    flat, mappings = flatten_state_dict(dict(objects or {}))
    values: dict[str, Any] = {}
    for fqn, value in flat.items():
        if isinstance(value, torch.Tensor):
            t = value.detach().contiguous()
            zero = (0,) * t.dim()
            shape = tuple(t.shape)
            blocks.append(Block(mappings[fqn], zero, shape, shape, partial(_same, t), t.dtype))
        else:
            values[fqn] = value
    planner = _WriteBlocks(blocks, values, {b.fqn: b.path for b in blocks} | mappings)
    writer = _Writer(str(path), thread_count=threads, sync_files=True)
    try:
        dcp.save({}, storage_writer=writer, planner=planner, process_group=group,
                 no_dist=group is None)  # fmt: skip
    except CheckpointException as e:
        raise _cause(e) from None  # the same error on every rank


class _Writer(FileSystemWriter):
    """DCP's file system writer, whose failures on a full disk say so."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Any:
        with out_of_space(self.path, f"the DCP checkpoint at {self.path}"):
            return super().write_data(plan, planner)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        with out_of_space(self.path, f"the DCP checkpoint's metadata at {self.path}"):
            super().finish(metadata, results)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


class _WriteBlocks(DefaultSavePlanner):
    def __init__(self, blocks: list[Block], values: dict[str, Any], paths: dict[str, Any]):
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=False)
        self.blocks = {MetadataIndex(b.fqn, torch.Size(b.offsets)): b for b in blocks}
        self.values, self.paths = values, paths
        self._written = threading.local()

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None,
                       is_coordinator: bool = False) -> None:  # fmt: skip
        self.state_dict, self.mappings, self.is_coordinator = {}, self.paths, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = [
            WriteItem(
                index=index,
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(b.offsets), torch.Size(b.sizes)),
                    properties=TensorProperties(dtype=b.dtype),
                    size=torch.Size(b.size),
                ),
            )
            for index, b in self.blocks.items()
        ]
        items += [
            WriteItem(index=MetadataIndex(k), type=WriteItemType.BYTE_IO) for k in self.values
        ]
        self.plan = SavePlan(items, planner_data=self.mappings)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(self.values[write_item.index.fqn], buf)
            buf.seek(0)
            return buf
        # DCP's writer keeps every tensor of a file until the whole file is written, but
        # writes them one after another: when it asks for the next block, this thread's
        # previous one is on disk, and its memory can go (the reference DCP keeps is
        # only read for the safetensors format, which this writer does not use).
        done = getattr(self._written, "last", None)
        if done is not None:
            _free(done)
        block = self.blocks[write_item.index]
        t = block.load()
        assert tuple(t.shape) == block.sizes, (block.fqn, tuple(t.shape), block.sizes)
        t = t.to(block.dtype).contiguous()
        if block.owned:
            storage = t.untyped_storage()
            mine = storage.resizable() or storage.data_ptr() in _MAPPED
            if storage.nbytes() != t.nbytes or not mine:
                t = t.clone()  # a view (the copy DCP would make) or memory not ours to free
            self._written.last = t
        return t


_MAPPED: weakref.WeakValueDictionary[int, mmap.mmap] = weakref.WeakValueDictionary()
"""The memory of :func:`mapped` tensors, by address."""
MAX_MAPPED = 4096
"""Mappings alive at once at most (DCP's writer holds every tensor of a file until the file
is written; a process has about 65,000 mappings in all): past it, tensors are allocated as
usual, and copied once before they are written."""


MAX_SPARE = 8
"""Written blocks' mappings kept for the next blocks (:func:`_free`), and for the next
write once one ends (:func:`_keep_spare`), at most."""
_spare: list[mmap.mmap] = []
_spare_lock = threading.Lock()


def mapped(shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized tensor of a MiB or more in anonymous memory of its own,
    page-aligned (a whole stored tensor is read straight into it with ``O_DIRECT``), whose
    storage is exactly its bytes: DCP's writer writes it without the copy it makes of a
    view, and frees it once written (:func:`_free`). Smaller ones, and any past
    :data:`MAX_MAPPED`, as ``torch.empty`` gives them.

    It takes the memory of a block already written, of up to twice its size, where one is
    spare (in this write, or kept from an earlier one: :func:`_keep_spare`): its pages are
    in memory unless the kernel took them back, where a fresh mapping's first touch cost a
    third of a cold read of 1 GB here (0.3 of 0.9 s). Where none fits, every spare block's
    pages go back to the system first: the memory held stays that of the blocks being read
    and written, as without spares."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < DIRECT_MIN_BYTES or len(_MAPPED) >= MAX_MAPPED:
        return torch.empty(shape, dtype=dtype)
    memory = _take_spare(nbytes)
    if memory is None:
        memory = anonymous(nbytes)
    t = torch.frombuffer(memory, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
    _MAPPED[t.data_ptr()] = memory
    return t


def _take_spare(nbytes: int) -> mmap.mmap | None:
    """The smallest spare mapping of ``nbytes`` to twice that, holding pages for ``nbytes``
    only, or ``None`` once every spare one's pages are returned (:func:`_return_spare`)."""
    with _spare_lock:
        fits = [m for m in _spare if nbytes <= len(m) <= 2 * nbytes]
        memory = min(fits, key=len) if fits else None
        if memory is not None:
            _spare.remove(memory)
    if memory is None:
        _return_spare()
        return None
    tail = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    if tail < len(memory):  # pages past the block go back: it holds its own bytes only
        memory.madvise(mmap.MADV_DONTNEED, tail, len(memory) - tail)
    return memory


def _free(t: torch.Tensor) -> None:
    """Gives up a written block's memory: a :func:`mapped` tensor's for the next block to
    be read into (:data:`MAX_SPARE` at most; past it, its pages go back to the system and it
    reads as zeros after), any other's storage resized to nothing."""
    storage = t.untyped_storage()
    memory = _MAPPED.get(storage.data_ptr())
    if memory is None:
        storage.resize_(0)
        return
    with _spare_lock:
        if len(_spare) < MAX_SPARE:
            _spare.append(memory)
            return
    memory.madvise(mmap.MADV_DONTNEED)


def _keep_spare() -> None:
    """Once a write is over: the spare mappings kept for the next write (an export after
    this one), their pages lazily freed (``MADV_FREE``). The kernel takes them back when it
    needs the memory; until then the next write reads into them without a fault, where
    fresh pages cost it the kernel's zeroing (and, on a VM that hands freed memory back to
    its host, the host's faults: 1.4-1.9 s against 0.8 s for an export of 1 GB here). None
    is in use: a block takes a spare one under the lock this holds."""
    with _spare_lock:
        for memory in _spare:
            with contextlib.suppress(OSError, AttributeError):  # a kernel without MADV_FREE
                memory.madvise(mmap.MADV_FREE)


def _return_spare() -> None:
    """The spare mappings' pages back to the system (where none fits a block)."""
    with _spare_lock:
        spare = _spare[:]
        _spare.clear()
    for memory in spare:
        memory.madvise(mmap.MADV_DONTNEED)
