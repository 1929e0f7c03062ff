"""Serving models a follower writes checkpoint rows into.

A :class:`ServingTarget` names each embedding table by its *unsharded* state-dict key
(``sparse.ebc.embedding_bags.t0.weight``), the key checkpoints use, and takes rows as
the checkpoint stores them (:class:`StoredRows`): fp32 values, or our quantizer's parts.

* :class:`FloatTarget`: the fp32 model the user trains. Rows are copied into the weight
  tensors (dequantized first when stored quantized).
* :class:`QuantizedTarget`: the model after
  ``torchrec.inference.modules.quantize_embeddings``. Each quantized table lives in an
  FBGEMM ``IntNBitTableBatchedEmbeddingBagsCodegen`` (TBE), one byte row per embedding
  row: ``[scale fp16 | bias fp16 | codes | zero padding to 16 bytes]`` for INT8, INT4
  and INT2 alike (INT8 too has fp16 scale and bias: ``quantize_state_dict`` quantizes
  every width with ``FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf``, and the TBE puts
  its trailing scale/bias first). The value is ``bias + scale * code``.

The invariant: a row the serving kernel reads dequantizes either to exactly the
checkpoint's row, or, where the serving format cannot hold that, to our adaptive
quantization of it, whose error per row is at most TorchRec's min/max quantization's.

* Stored uniform rows (symmetric/asymmetric/adaptive) of 2, 3 or 4 bits carry fp16
  scale and bias, as serving does. At the serving width their code bytes are copied
  as they are; at a narrower width (2 into INT4, 3 into INT8, ...) their codes are
  repacked wider under the same scale and bias. Either way the served row dequantizes
  to exactly the checkpoint's row, with no quantization error added.
* Anything else (fp32, 8-bit rows with fp32 scale/bias, k-means, casts, a wider
  width) is dequantized and quantized for serving with our adaptive range search,
  which starts from min/max and keeps it where nothing beats it. 2 and 4 bits use
  ``quantize(rows, "adaptive", bits)`` as is. INT8 serving needs fp16 scale/bias,
  which our 8-bit format (fp32 scale/bias) is not: the searched ranges are encoded by
  FBGEMM's ``FloatOrHalfToFusedNBitRowwiseQuantizedSBHalfWithRowwiseMinMax`` and each
  row keeps whichever of that and plain min/max has the lower error (the search picks
  its range for fp32 parameters, which fp16 rounding can spoil on a few rows).

Tables the quantization left in fp32 or fp16 (``per_table_weight_dtype``, or an
``EmbeddingCollection`` that ``quantize_embeddings`` does not map by default) take the
values as they are.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection
from torchrec.quant.embedding_modules import EmbeddingCollection as QuantEmbeddingCollection

from torchrec_cnr.rowcopy import put_rows
from torchrec_cnr.serving.rows import PreparedRows, StoredRows, finite_rows_of
from torchrec_cnr.serving.tbe import (
    BITS,
    ServingFormat,
    TbeTable,
    join_key,
    read_served,
    serving_nbit,
    set_weights_buffer,
    tbe_tables,
    weights_buffer,
)
from torchrec_cnr.snapshot import page_aligned
from torchrec_cnr.snapshot.buffers import advise_huge_pages

__all__ = [
    "FloatTarget",
    "PreparedRows",
    "QuantizedTarget",
    "ServingFormat",
    "StoredRows",
    "TableSlot",
    "ServingTarget",
]


@dataclass(frozen=True)
class TableSlot:
    """One serving table, as a follower sees it."""

    num_embeddings: int
    """Rows the table holds."""
    embedding_dim: int
    """Values per row."""
    format: ServingFormat
    """How the serving model holds the rows: ``fp32``/``fp16`` values, or ``int8``/``int4``/
    ``int2`` codes with fp16 scale and bias per row."""

    @property
    def bits(self) -> int | None:
        """Code width of an ``int*`` format, ``None`` for float formats."""
        return BITS.get(self.format)


def _copy_aside(t: Tensor) -> Tensor:
    """Swap mode's copy of a served buffer, on its device; on the CPU in page-aligned
    memory, which from a huge page up is advised for huge pages (:func:`page_aligned`)."""
    if t.device.type != "cpu":
        return t.detach().clone()
    return page_aligned(t.numel(), t.dtype).view(t.shape).copy_(t.detach())


class ServingTarget(abc.ABC):
    """A serving model a follower writes checkpoint rows and dense tensors into.

    A write is :meth:`prepare` (checks, dequantizes, quantizes for serving: the slow
    part) then :meth:`write_prepared` (copies into the model: the fast part), so a
    follower can prepare while the model serves and block lookups only for the copies.
    :meth:`write_rows` does both.

    Subclasses fill ``_tables`` (key -> slot) and ``_dense`` (name -> tensor) and
    implement ``_prepare``, ``_destinations`` and ``_read`` (and ``_buffers`` and
    ``_set_buffer`` for swap mode); argument checks live here.
    """

    def __init__(self) -> None:
        self._tables: dict[str, TableSlot] = {}
        self._dense: dict[str, Tensor] = {}
        self._spare: dict[str, Tensor] | None = None

    # -- swap mode: a second copy of the tables, written aside and swapped in ----------

    @property
    def swapping(self) -> bool:
        """Whether :meth:`enable_swap` made a spare copy of the tables."""
        return self._spare is not None

    def table_bytes(self) -> int:
        """Bytes of the buffers that hold table rows: what swap mode's spare copy takes."""
        return sum(t.numel() * t.element_size() for t in self._buffers().values())

    def enable_swap(self) -> int:
        """Makes a spare copy of every buffer that holds table rows (the weights, or each
        TBE's one weights buffer): writes with ``spare=True`` go there, and
        :meth:`swap` makes it the served copy in a few pointer assignments. Returns the
        bytes it took."""
        if self._spare is None:
            self._spare = {name: _copy_aside(t) for name, t in self._buffers().items()}
        return sum(t.numel() * t.element_size() for t in self._spare.values())

    def swap(self) -> None:
        """Serves the spare copy, every table at once, and keeps the served one as the
        spare (call with lookups held off)."""
        assert self._spare is not None, "enable_swap() first"
        live = self._buffers()
        for name, spare in self._spare.items():
            self._set_buffer(name, spare)
        self._spare = {name: t.detach() for name, t in live.items()}

    def sync_spare(self) -> None:
        """Copies every served buffer into the spare (after a swap that wrote every row
        aside, such as a cold start)."""
        assert self._spare is not None, "enable_swap() first"
        with torch.no_grad():
            for name, live in self._buffers().items():
                self._spare[name].copy_(live)

    def _advise_huge_pages(self) -> None:
        """The tables' memory advised for huge pages (an update writes rows at random
        places of them); a swap mode's spare copy is made in huge pages
        (:meth:`enable_swap`)."""
        for t in self._buffers().values():
            advise_huge_pages(t)

    def _spare_view(self, view: Tensor) -> Tensor:
        """The spare copy's view of what ``view`` (into a served buffer) covers."""
        assert self._spare is not None
        for name, live in self._buffers().items():
            if view.untyped_storage().data_ptr() == live.untyped_storage().data_ptr():
                spare = self._spare[name]
                offset = view.storage_offset() - live.storage_offset() + spare.storage_offset()
                return spare.as_strided(view.shape, view.stride(), offset)
        raise AssertionError("a table view outside the buffers the target doubles")

    def _buffers(self) -> dict[str, Tensor]:
        """The contiguous tensors that hold every table's rows, by a name of the target's."""
        raise NotImplementedError(f"{type(self).__name__} has no swap mode")

    def _set_buffer(self, name: str, tensor: Tensor) -> None:
        """Points the model at ``tensor`` for buffer ``name``."""
        raise NotImplementedError(f"{type(self).__name__} has no swap mode")

    def tables(self) -> dict[str, TableSlot]:
        """Unsharded state-dict key -> its :class:`TableSlot`."""
        return dict(self._tables)

    def dense_names(self) -> dict[str, tuple[int, ...]]:
        """State-dict name -> shape of each non-embedding tensor :meth:`write_dense` takes."""
        return {name: tuple(t.shape) for name, t in self._dense.items()}

    def prepare(self, key: str, rows: StoredRows, ids: Tensor | None = None) -> PreparedRows:
        """Convert ``rows`` to table ``key``'s serving form; the model is not touched.

        Args:
            key: Unsharded state-dict key of the table.
            rows: (n, dim) rows as the checkpoint stores them.
            ids: (n,) their ids, only to name a bad row in errors (else its position).

        Raises:
            ValueError: Unknown key, rows of another dim, or values the serving format
                cannot hold (non-finite, fp16 overflow); the message names the key.
        """
        slot = self._slot(key)
        n, dim = rows.shape
        if dim != slot.embedding_dim:
            raise ValueError(f"table {key!r}: rows have dim {dim}, the table {slot.embedding_dim}")
        if ids is not None and ids.numel() != n:
            raise ValueError(f"table {key!r}: {n} rows for {ids.numel()} ids")
        return PreparedRows(key, n, self._prepare(key, rows, ids) if n else ())

    def write_prepared(
        self, key: str, ids: Tensor, rows: PreparedRows, spare: bool = False
    ) -> None:
        """Write rows :meth:`prepare` made for ``key`` at ``ids``.

        Args:
            key: Unsharded state-dict key of the table.
            ids: (n,) int64 row ids, strictly ascending.
            rows: ``prepare(key, ...)`` of n rows.
            spare: into the spare copy (swap mode), not the served one.

        Raises:
            ValueError: Unknown key, bad ids, or rows prepared for another table or count.
        """
        self._check(key, ids)
        if rows.key != key or rows.count != ids.numel():
            raise ValueError(
                f"table {key!r}: rows were prepared for {rows.key!r} ({rows.count} rows), "
                f"written to {ids.numel()} ids"
            )
        if rows.count:
            for dest, src in zip(self._destinations(key), rows.tensors):
                put_rows(self._spare_view(dest) if spare else dest, ids, src)

    def write_rows(self, key: str, ids: Tensor, rows: StoredRows) -> None:
        """Overwrite rows ``ids`` of table ``key`` with ``rows``.

        Args:
            key: Unsharded state-dict key of the table.
            ids: (n,) int64 row ids, strictly ascending.
            rows: (n, dim) rows as the checkpoint stores them.

        Raises:
            ValueError: As :meth:`prepare` and :meth:`write_prepared`.
        """
        self._check(key, ids)
        self.write_prepared(key, ids, self.prepare(key, rows, ids))

    def read_rows(self, key: str, ids: Tensor) -> Tensor:
        """The rows ``ids`` of table ``key`` as the serving kernel sees them.

        Args:
            key: Unsharded state-dict key of the table.
            ids: (n,) int64 row ids, strictly ascending.

        Returns:
            (n, dim) fp32, a copy.
        """
        slot = self._check(key, ids)
        if not ids.numel():
            return torch.zeros(0, slot.embedding_dim)
        return self._read(key, ids)

    def write_dense(self, name: str, tensor: Tensor) -> None:
        """Copy ``tensor`` into the model's non-embedding parameter or buffer ``name``.

        Raises:
            ValueError: Unknown name, or a shape other than the model's.
        """
        dest = self._dense.get(name)
        if dest is None:
            raise ValueError(
                f"{name!r} is no dense tensor of the serving model; known: {sorted(self._dense)}"
            )
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(
                f"dense tensor {name!r} is {tuple(tensor.shape)}, the model's is {tuple(dest.shape)}"
            )
        with torch.no_grad():
            dest.copy_(tensor)

    @abc.abstractmethod
    def _prepare(self, key: str, rows: StoredRows, ids: Tensor | None) -> tuple[Tensor, ...]:
        """The serving form of checked, non-empty rows."""

    @abc.abstractmethod
    def _destinations(self, key: str) -> tuple[Tensor, ...]:
        """The served views the serving form's tensors are written into, row by row."""

    @abc.abstractmethod
    def _read(self, key: str, ids: Tensor) -> Tensor:
        """Read checked, non-empty ids."""

    def _slot(self, key: str) -> TableSlot:
        slot = self._tables.get(key)
        if slot is None:
            raise ValueError(
                f"table {key!r} is not in the serving model; known: {sorted(self._tables)}"
            )
        return slot

    def _check(self, key: str, ids: Tensor) -> TableSlot:
        slot = self._slot(key)
        if ids.dim() != 1 or ids.dtype != torch.int64:
            raise ValueError(
                f"table {key!r}: ids must be a 1-D int64 tensor, got {tuple(ids.shape)} {ids.dtype}"
            )
        if ids.numel():
            # Duplicate ids would make the written value depend on the copy order.
            if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
                raise ValueError(f"table {key!r}: ids must be strictly ascending")
            if int(ids[0]) < 0 or int(ids[-1]) >= slot.num_embeddings:
                raise ValueError(
                    f"table {key!r}: ids span [{int(ids[0])}, {int(ids[-1])}], the table has "
                    f"{slot.num_embeddings} rows"
                )
        return slot

    def _collect_dense(self, model: nn.Module, table_owners: Iterable[str]) -> None:
        """Every state-dict tensor outside the embedding modules at ``table_owners``."""
        owners = tuple(table_owners)

        def owned(name: str) -> bool:
            return any(p == "" or name.startswith(p + ".") for p in owners)

        for name, value in model.state_dict(keep_vars=True).items():
            if isinstance(value, Tensor) and not owned(name):
                self._dense[name] = value


def _float_tables(prefix: str, module: nn.Module) -> dict[str, Tensor]:
    """Key -> weight of a float torchrec ``EmbeddingBagCollection``/``EmbeddingCollection``."""
    if isinstance(module, EmbeddingBagCollection):
        return {
            join_key(prefix, "embedding_bags", c.name, "weight"): module.embedding_bags[
                c.name
            ].weight
            for c in module.embedding_bag_configs()
        }
    assert isinstance(module, EmbeddingCollection)
    return {
        join_key(prefix, "embeddings", c.name, "weight"): module.embeddings[c.name].weight
        for c in module.embedding_configs()
    }


def _bad_row(key: str, bad: Tensor, ids: Tensor | None, what: str) -> ValueError:
    """The error for the first row flagged in (n,) bool ``bad``, named by its id."""
    at = int(bad.nonzero()[0, 0])
    row = at if ids is None else int(ids[at])
    return ValueError(f"table {key!r}: row {row} {what}")


def _float_values(rows: StoredRows, weight: Tensor) -> Tensor:
    """(n, dim) values in ``weight``'s dtype and device."""
    return rows.dequantize().to(device=weight.device, dtype=weight.dtype)


class FloatTarget(ServingTarget):
    """The unsharded fp32 model: torchrec ``EmbeddingBagCollection`` (weighted or not)
    and ``EmbeddingCollection`` tables, anywhere in ``model``.

    Example::

        target = FloatTarget(model)
        target.write_rows("sparse.ebc.embedding_bags.t0.weight", ids, StoredRows.fp32(rows))

    Raises:
        ValueError: ``model`` holds quantized embedding modules (use
            :class:`QuantizedTarget`) or no embedding table at all.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self._weights: dict[str, Tensor] = {}
        owners: list[str] = []
        for prefix, module in model.named_modules():
            if isinstance(module, (QuantEmbeddingBagCollection, QuantEmbeddingCollection)):
                raise ValueError(
                    f"module {prefix!r} is a quantized {type(module).__name__}; use QuantizedTarget"
                )
            if isinstance(module, (EmbeddingBagCollection, EmbeddingCollection)):
                owners.append(prefix)
                self._weights.update(_float_tables(prefix, module))
        if not self._weights:
            raise ValueError(
                "the model holds no torchrec EmbeddingBagCollection/EmbeddingCollection"
            )
        for key, w in self._weights.items():
            self._tables[key] = TableSlot(int(w.shape[0]), int(w.shape[1]), "fp32")
        self._collect_dense(model, owners)
        self._advise_huge_pages()

    def _prepare(self, key: str, rows: StoredRows, ids: Tensor | None) -> tuple[Tensor, ...]:
        return (_float_values(rows, self._weights[key]),)

    def _destinations(self, key: str) -> tuple[Tensor, ...]:
        return (self._weights[key].detach(),)

    def _read(self, key: str, ids: Tensor) -> Tensor:
        w = self._weights[key]
        return w.detach()[ids.to(w.device)].float()

    def _buffers(self) -> dict[str, Tensor]:
        return {key: w.detach() for key, w in self._weights.items()}

    def _set_buffer(self, name: str, tensor: Tensor) -> None:
        self._weights[name].data = tensor


class QuantizedTarget(ServingTarget):
    """A model after ``torchrec.inference.modules.quantize_embeddings``.

    Takes every table of the quantized ``EmbeddingBagCollection``/``EmbeddingCollection``
    modules (see the module docstring for what a write does per format), plus the float
    ones the quantization left alone.

    Example::

        served = quantize_embeddings(model, dtype=torch.quint4x2, inplace=False)
        target = QuantizedTarget(served)
        target.write_rows(key, ids, StoredRows.quantized(blobs, "adaptive", 4, (n, dim)))

    Raises:
        ValueError: No quantized embedding module in ``model``, or a table whose TBE
            cannot be written in place (pruned, cached, key-value, other row layout).
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self._tbe: dict[str, TbeTable] = {}
        self._weights: dict[str, Tensor] = {}
        owners: list[str] = []
        for prefix, module in model.named_modules():
            if isinstance(module, (QuantEmbeddingBagCollection, QuantEmbeddingCollection)):
                owners.append(prefix)
                self._tbe.update(tbe_tables(prefix, module))
            elif isinstance(module, (EmbeddingBagCollection, EmbeddingCollection)):
                owners.append(prefix)
                self._weights.update(_float_tables(prefix, module))
        if not self._tbe:
            raise ValueError("the model holds no quantized embedding module; use FloatTarget")
        for key, t in self._tbe.items():
            self._tables[key] = TableSlot(int(t.views()[0].shape[0]), t.dim, t.format)
        for key, w in self._weights.items():
            self._tables[key] = TableSlot(int(w.shape[0]), int(w.shape[1]), "fp32")
        self._collect_dense(model, owners)
        self._advise_huge_pages()

    def _prepare(self, key: str, rows: StoredRows, ids: Tensor | None) -> tuple[Tensor, ...]:
        if key in self._weights:
            return (_float_values(rows, self._weights[key]),)
        table = self._tbe[key]
        bits = BITS.get(table.format)
        if bits is not None:
            return (serving_nbit(rows, bits, key, ids),)
        dtype = torch.float32 if table.format == "fp32" else torch.float16
        values = rows.dequantize().to(dtype)
        bad = ~finite_rows_of(values)
        if bool(bad.any()):
            raise _bad_row(key, bad, ids, f"is not finite as {dtype}")
        return (values.view(torch.uint8),)

    def _destinations(self, key: str) -> tuple[Tensor, ...]:
        if key in self._weights:
            return (self._weights[key].detach(),)
        return (self._tbe[key].rows(),)

    def _buffers(self) -> dict[str, Tensor]:
        out = {f"tbe{i}": weights_buffer(tbe) for i, tbe in enumerate(self._tbes())}
        return out | {key: w.detach() for key, w in self._weights.items()}

    def _set_buffer(self, name: str, tensor: Tensor) -> None:
        if name in self._weights:
            self._weights[name].data = tensor
        else:
            set_weights_buffer(self._tbes()[int(name.removeprefix("tbe"))], tensor)

    def _tbes(self) -> list[nn.Module]:
        """Each TBE once, in the order its first table was found."""
        return list({id(t.tbe): t.tbe for t in self._tbe.values()}.values())

    def _read(self, key: str, ids: Tensor) -> Tensor:
        if key in self._weights:
            w = self._weights[key]
            return w.detach()[ids.to(w.device)].float()
        return read_served(self._tbe[key], ids)
