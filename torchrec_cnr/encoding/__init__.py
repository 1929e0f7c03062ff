"""Stage 4: storage formats, per-row quantization of each table, and the shard writer
that encodes staged rows and writes them in the checkpoint format."""

from torchrec_cnr.encoding.codec import (
    EncodedShard,
    ShardRecord,
    StateInfo,
    decode_weight,
    dtype_name,
    encode_shard,
)
from torchrec_cnr.encoding.formats import FP32, Format, FormatResolver
from torchrec_cnr.encoding.writer import RankWrite, ShardWriter

__all__ = [
    "FP32",
    "EncodedShard",
    "Format",
    "FormatResolver",
    "RankWrite",
    "ShardRecord",
    "ShardWriter",
    "StateInfo",
    "decode_weight",
    "dtype_name",
    "encode_shard",
]
