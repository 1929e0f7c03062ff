"""FBGEMM's inference TBE as a follower writes it: which of a quantized TorchRec module's
tables are writable in place, views into their rows, rows in their layout, and rows read
back as the lookup kernel serves them.

An ``IntNBitTableBatchedEmbeddingBagsCodegen`` holds one byte row per embedding row:
``[scale fp16 | bias fp16 | codes | zero padding to 16 bytes]`` for INT8, INT4 and INT2
alike, or the fp16/fp32 values of a float table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from fbgemm_gpu.split_embedding_configs import SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_inference import (
    IntNBitTableBatchedEmbeddingBagsCodegen,
)
from fbgemm_gpu.tbe.cache.kv_embedding_ops_inference import KVEmbeddingInference
from torch import Tensor, nn
from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection
from torchrec.quant.embedding_modules import EmbeddingCollection as QuantEmbeddingCollection

from torchrec_cnr.quantization import (
    SB_BYTES,
    fused_int8_rows,
    pack_codes,
    packed_nbytes,
    quantize,
    unpack_codes,
)
from torchrec_cnr.serving.rows import StoredRows

__all__ = [
    "BITS",
    "FORMATS",
    "ServingFormat",
    "TbeTable",
    "check_tbe",
    "join_key",
    "read_served",
    "serving_nbit",
    "tbe_tables",
]


def join_key(*parts: str) -> str:
    """A state-dict key from its non-empty parts (``prefix`` is empty at the top)."""
    return ".".join(p for p in parts if p)


ServingFormat = Literal["fp32", "fp16", "int8", "int4", "int2"]
"""How a serving table holds its rows."""

FORMATS: dict[SparseType, ServingFormat] = {
    SparseType.FP32: "fp32",
    SparseType.FP16: "fp16",
    SparseType.INT8: "int8",
    SparseType.INT4: "int4",
    SparseType.INT2: "int2",
}
BITS: dict[str, int] = {"int8": 8, "int4": 4, "int2": 2}


@dataclass(frozen=True)
class TbeTable:
    """Table ``index`` of an inference TBE."""

    tbe: IntNBitTableBatchedEmbeddingBagsCodegen
    index: int
    dim: int
    format: ServingFormat

    def views(self) -> tuple[Tensor, Tensor | None]:
        """(rows, data bytes) uint8 and (rows, 4) scale/bias views into the TBE's weights.

        Data bytes are the codes (``dim * bits / 8``) or the fp16/fp32 values; scale/bias
        is ``None`` for float formats. Fetched per call so they follow the TBE's buffers
        if it moves or reloads them.
        """
        data, sb = self.tbe.split_embedding_weights(split_scale_shifts=True)[self.index]
        return data, sb

    def rows(self) -> Tensor:
        """(rows, bytes) uint8 view of each row as the TBE holds it, its padding left out:
        ``[scale/bias | codes]`` of an integer format, the values of a float one."""
        data, sb = self.views()
        if sb is None:
            return data
        return sb.as_strided((sb.shape[0], sb.shape[1] + data.shape[1]), sb.stride())


def _buffer_name(tbe: IntNBitTableBatchedEmbeddingBagsCodegen) -> str:
    """The attribute holding every table's rows, which the lookup kernel is handed."""
    return "weights_host" if tbe.host_size > 0 else "weights_dev"


def weights_buffer(tbe: nn.Module) -> Tensor:
    """The one uint8 buffer that holds the rows of every table of ``tbe``."""
    assert isinstance(tbe, IntNBitTableBatchedEmbeddingBagsCodegen)
    return getattr(tbe, _buffer_name(tbe))


def set_weights_buffer(tbe: nn.Module, buffer: Tensor) -> None:
    """Points ``tbe``'s lookups at ``buffer``, laid out as :func:`weights_buffer`'s."""
    assert isinstance(tbe, IntNBitTableBatchedEmbeddingBagsCodegen)
    name = _buffer_name(tbe)
    old = getattr(tbe, name)
    assert buffer.shape == old.shape and buffer.dtype == old.dtype
    setattr(tbe, name, buffer)


def check_tbe(key: str, tbe: nn.Module) -> None:
    """Raise unless writes into ``tbe``'s weights are what its kernel reads."""
    why = None
    if isinstance(tbe, KVEmbeddingInference) or not isinstance(
        tbe, IntNBitTableBatchedEmbeddingBagsCodegen
    ):
        why = f"{type(tbe).__name__} is not a plain IntNBitTableBatchedEmbeddingBagsCodegen"
    elif tbe.reverse_qparam or tbe.scale_bias_size_in_bytes != SB_BYTES:
        why = "its scale/bias are not 4 bytes at the front of each row"
    elif (
        tbe.index_remapping_hash_table_cpu is not None
        or tbe.index_remapping_hash_table.numel() > 0
        or tbe.index_remappings_array.numel() > 0
    ):
        why = "it is pruned: row ids are remapped"
    elif tbe.lxu_cache_weights.numel() > 0:
        why = "it caches rows, which writes to the backing weights would not reach"
    elif tbe.uvm_size > 0:
        why = "its rows are in unified memory, apart from its one weights buffer"
    if why is not None:
        raise ValueError(f"table {key!r} cannot be written: {why}")


def tbe_tables(prefix: str, module: nn.Module) -> dict[str, TbeTable]:
    """Key -> table of a quantized torchrec EBC/EC, checked to be writable."""
    if isinstance(module, QuantEmbeddingBagCollection):
        attr = "embedding_bags"
    else:
        assert isinstance(module, QuantEmbeddingCollection)
        attr = "embeddings"
    out: dict[str, TbeTable] = {}
    # torchrec builds one TBE per group of _key_to_tables, its tables in list order
    # (torchrec/quant/embedding_modules.py, EmbeddingBagCollection.__init__).
    for configs, tbe in zip(module._key_to_tables.values(), module._emb_modules):
        for index, config in enumerate(configs):
            key = join_key(prefix, attr, config.name, "weight")
            check_tbe(key, tbe)
            assert isinstance(tbe, IntNBitTableBatchedEmbeddingBagsCodegen)
            _, _, dim, weight_ty, _ = tbe.embedding_specs[index]
            fmt = FORMATS.get(weight_ty)
            if fmt is None:
                raise ValueError(f"table {key!r}: serving type {weight_ty} is not supported")
            table = TbeTable(tbe, index, int(dim), fmt)
            bits = BITS.get(fmt)
            if bits is not None and table.views()[0].shape[1] * 8 != dim * bits:
                raise ValueError(f"table {key!r}: dim {dim} does not fill whole bytes at {fmt}")
            out[key] = table
    return out


def serving_nbit(rows: StoredRows, bits: int, key: str, ids: Tensor | None) -> Tensor:
    """``rows`` as a ``bits``-bit serving table holds them (:meth:`TbeTable.rows`): one
    write a row, where the scale/bias and the codes written apart cost two passes over
    the table's scattered rows.

    Returns:
        (n, 4 + dim * bits / 8) uint8: fp16 scale, fp16 bias, codes.
    """
    return torch.cat(_nbit_parts(rows, bits, key, ids)[::-1], dim=1)


def _nbit_parts(rows: StoredRows, bits: int, key: str, ids: Tensor | None) -> tuple[Tensor, Tensor]:
    """(codes, scale/bias) of :func:`serving_nbit`'s rows."""
    n, dim = rows.shape
    nbytes = dim * bits // 8
    q = rows.fused_nbit()
    if q is not None and q.bits <= bits:
        # Same fp16 scale/bias, codes as stored: the served row is the checkpoint's.
        stored = packed_nbytes(dim, q.bits)
        sb = q.data[:, stored:]
        if q.bits == bits:
            # Byte copy; bytes past dim * bits / 8 only hold our row padding.
            return q.data[:, :nbytes], sb
        codes = unpack_codes(q.data[:, :stored], q.bits, dim)
        return pack_codes(codes, bits)[:, :nbytes], sb
    x = rows.dequantize()
    if bits == 8:
        data = fused_int8_rows(x, key, ids)
    else:
        data = quantize(x, "adaptive", bits, name=key, row_ids=ids).data
    return data[:, :nbytes], data[:, -SB_BYTES:]


def read_served(table: TbeTable, ids: Tensor) -> Tensor:
    """(n, dim) fp32 rows ``ids`` of ``table`` as its lookup kernel serves them."""
    data, sb = table.views()
    ids = ids.to(data.device)
    bits = BITS.get(table.format)
    if bits is None:
        dtype = torch.float32 if table.format == "fp32" else torch.float16
        return data[ids].view(dtype).float()
    assert sb is not None
    codes = data[ids]
    if codes.shape[1] % 2:
        # FBGEMM's dequantize wants the fp16 scale/bias 2-byte aligned.
        codes = torch.nn.functional.pad(codes, (0, 1))
    # The CPU lookup kernel's output for a one-id bag equals this op's, bit for bit
    # (tests check it), so this is the row as served.
    fused = torch.cat([codes, sb[ids]], 1)
    out = torch.ops.fbgemm.FusedNBitRowwiseQuantizedSBHalfToFloat(fused, bits)
    return out[:, : table.dim].float()
