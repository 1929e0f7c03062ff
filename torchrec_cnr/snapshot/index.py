"""A checkpoint directory's index (``.snapshot_metadata``): torchsnapshot's format, as data.

torchsnapshot's reader opens the directories this library writes, and this library's
reader opens torchsnapshot's snapshots: both sides agree on the index alone, which is
JSON (torchsnapshot reads it as YAML, of which JSON is a subset). Its entries are tagged
by a ``type`` key; each class here carries the keys of one tag, in torchsnapshot's order,
and nothing else. The index is written and read here without torchsnapshot's package,
whose import loads FBGEMM and sympy (0.6 s of CPU a process): a writer process and the
command line read and write indexes and need neither.
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch

__all__ = [
    "SNAPSHOT_VERSION",
    "ChunkedTensorEntry",
    "DictEntry",
    "IndexEntry",
    "IndexPart",
    "IndexShard",
    "ObjectEntry",
    "OtherEntry",
    "PrimitiveEntry",
    "TensorEntry",
    "index_bytes",
    "index_dtype_name",
    "index_part",
    "named_dtype",
    "parse_index",
]

SNAPSHOT_VERSION = "0.1.0"
"""The torchsnapshot version whose index format checkpoint directories carry."""

_DTYPES = {
    str(dtype): dtype
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16,
                  torch.complex128, torch.complex64, torch.int64, torch.int32, torch.int16,
                  torch.int8, torch.uint8, torch.bool, torch.qint32, torch.qint8, torch.quint8)
}  # fmt: skip
"""The dtypes torchsnapshot stores, by the names its index gives them (``torch.float32``)."""


def index_dtype_name(dtype: torch.dtype) -> str:
    """``dtype`` as the index names it (``torch.float32``; a shard record's
    :func:`torchrec_cnr.schema.dtype_name` is ``float32``); ``ValueError`` for one
    torchsnapshot cannot store."""
    name = str(dtype)
    if name not in _DTYPES:
        raise ValueError(f"dtype {dtype} is not one a torchsnapshot index can name")
    return name


def named_dtype(name: str) -> torch.dtype:
    """The dtype the index names ``name``; ``ValueError`` for a name it does not use."""
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r} in a torchsnapshot index")
    return _DTYPES[name]


@dataclass
class OtherEntry:
    """An entry of a type this library neither writes nor reads as a value (``list``,
    ``ShardedTensor``...): kept by its tag, refused when read."""

    type: str


class _Tagged:
    """An entry whose tag is its class's: ``TAG``, written first as its ``type``."""

    TAG: ClassVar[str]

    @property
    def type(self) -> str:
        return self.TAG


@dataclass
class TensorEntry(_Tagged):
    """A tensor stored whole in ``location``, or in its ``byte_range`` (``[start, end)``)."""

    TAG: ClassVar[str] = "Tensor"
    location: str
    serializer: str
    """``buffer_protocol`` (its raw bytes) or ``torch_save``."""
    dtype: str
    shape: list[int]
    replicated: bool
    byte_range: list[int] | None = None


@dataclass
class IndexShard:
    """One chunk of a :class:`ChunkedTensorEntry`: where it sits in the whole, and its tensor."""

    offsets: list[int]
    sizes: list[int]
    tensor: TensorEntry


@dataclass
class ChunkedTensorEntry(_Tagged):
    """A tensor stored as chunks of rows, each a :class:`TensorEntry`."""

    TAG: ClassVar[str] = "ChunkedTensor"
    dtype: str
    shape: list[int]
    chunks: list[IndexShard]
    replicated: bool


@dataclass
class DictEntry(_Tagged):
    """A folder of the logical paths: the keys below it, in order."""

    TAG: ClassVar[str] = "dict"
    keys: list[str | int]


@dataclass
class ObjectEntry(_Tagged):
    """A pickled object stored in ``location``."""

    TAG: ClassVar[str] = "object"
    location: str
    serializer: str
    obj_type: str
    replicated: bool


@dataclass
class PrimitiveEntry:
    """A value stored in the index itself; ``type`` is its Python type's name."""

    type: str
    serialized_value: str
    """The value as text: ``bytes`` and ``float`` (its 8 bytes) in base64."""
    replicated: bool
    readable: str | None = None

    @classmethod
    def of_bytes(cls, value: bytes) -> PrimitiveEntry:
        return cls("bytes", base64.b64encode(value).decode(), False)

    def value(self) -> int | str | bool | bytes | float:
        """The stored value."""
        text = self.serialized_value
        if self.type == "bytes":
            return base64.b64decode(text)
        if self.type == "float":
            return float(struct.unpack("d", base64.b64decode(text))[0])
        if self.type == "bool":
            if text not in ("True", "False"):
                raise ValueError(f"a bool entry holds {text!r}")
            return text == "True"
        return int(text) if self.type == "int" else text


IndexEntry = (
    TensorEntry | ChunkedTensorEntry | DictEntry | ObjectEntry | PrimitiveEntry | OtherEntry
)
"""An entry of the index."""


def _chunked(raw: dict[str, Any]) -> ChunkedTensorEntry:
    chunks = []
    for c in raw.pop("chunks"):
        tensor = c["tensor"]
        tensor.pop("type", None)
        chunks.append(IndexShard(c["offsets"], c["sizes"], TensorEntry(**tensor)))
    return ChunkedTensorEntry(chunks=chunks, **raw)


def _primitive(kind: str) -> Callable[[dict[str, Any]], PrimitiveEntry]:
    return lambda raw: PrimitiveEntry(kind, **raw)


_PARSERS: dict[str, Callable[[dict[str, Any]], IndexEntry]] = {
    TensorEntry.TAG: lambda raw: TensorEntry(**raw),
    ChunkedTensorEntry.TAG: _chunked,
    DictEntry.TAG: lambda raw: DictEntry(**raw),
    ObjectEntry.TAG: lambda raw: ObjectEntry(**raw),
    **{kind: _primitive(kind) for kind in ("int", "str", "bool", "bytes", "float")},
}
"""Tag -> the entry of the rest of its keys (a fresh JSON object, consumed)."""


def _entry(raw: dict[str, Any]) -> IndexEntry:
    kind = raw.pop("type")
    parse = _PARSERS.get(kind)
    return OtherEntry(kind) if parse is None else parse(raw)


def parse_index(data: bytes) -> dict[str, IndexEntry]:
    """An index's entries by logical path.

    Raises:
        ValueError, KeyError, TypeError: ``data`` is not such an index.
    """
    return {path: _entry(raw) for path, raw in json.loads(data)["manifest"].items()}


def _plain(obj: Any) -> Any:
    """An entry (or a list or dict of them) as the JSON values of its keys, tag first."""
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    names = _FIELDS.get(type(obj))
    if names is None:
        return obj
    tag = {"type": obj.type} if isinstance(obj, _Tagged) else {}
    return tag | {name: _plain(getattr(obj, name)) for name in names}


_FIELDS: dict[type, tuple[str, ...]] = {
    cls: tuple(f.name for f in fields(cls))
    for cls in (TensorEntry, ChunkedTensorEntry, IndexShard, DictEntry, ObjectEntry,
                PrimitiveEntry, OtherEntry)
}  # fmt: skip


@dataclass
class IndexPart:
    """One writer's share of a checkpoint's index, serialized by that writer (so that the
    rank that writes the index only joins them)."""

    entries: bytes = b""
    """Its entries as the members of a JSON object: ``"<logical path>": {...}, ...``."""
    folders: dict[str, list[str]] = field(default_factory=dict)
    """The folder entries its paths need: folder -> keys, in order."""


def index_part(entries: dict[str, IndexEntry]) -> IndexPart:
    """A writer's share of the index: ``entries`` by logical path."""
    folders: dict[str, dict[str, None]] = {}
    for logical in sorted(entries):
        path = logical
        while "/" in path:
            parent, _, key = path.rpartition("/")
            folders.setdefault(parent, {})[key] = None
            path = parent
    members = json.dumps(_plain(entries))[1:-1].encode()
    return IndexPart(members, {k: list(v) for k, v in folders.items()})


def index_bytes(parts: list[IndexPart], world_size: int) -> bytes:
    """The index of a checkpoint directory from its writers' shares, with the folder
    entries torchsnapshot's reader expects.

    JSON on one line: torchsnapshot's own writer indents it with json's pure-Python
    encoder, ~300 us an entry on one rank (a minute for a commit of 100k shards); both
    read alike."""
    folders: dict[str, dict[str, None]] = {}
    for part in parts:
        for folder, keys in part.folders.items():
            folders.setdefault(folder, {}).update(dict.fromkeys(keys))
    dicts = {k: DictEntry(keys=list(v)) for k, v in folders.items()}
    members = [json.dumps(_plain(dicts))[1:-1].encode(), *(p.entries for p in parts)]
    head = json.dumps({"version": SNAPSHOT_VERSION, "world_size": world_size})[:-1]
    return f'{head}, "manifest": {{'.encode() + b", ".join(m for m in members if m) + b"}}"
