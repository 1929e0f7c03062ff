"""Stage 4: storage formats, per-row quantization of each table, and the shard writer
that encodes staged rows and writes them in the checkpoint format."""

from torchrec_cnr.encoding.codec import (
    EncodedShard,
    ShardContent,
    build_record,
    decode_weight,
    encode_shard,
)
from torchrec_cnr.encoding.formats import FormatResolver
from torchrec_cnr.encoding.writer import RankWrite, ShardWriter, write_part
from torchrec_cnr.schema import FP32, Format, ShardRecord, StateInfo, dtype_name

__all__ = [
    "FP32",
    "EncodedShard",
    "Format",
    "FormatResolver",
    "RankWrite",
    "ShardContent",
    "ShardRecord",
    "ShardWriter",
    "StateInfo",
    "build_record",
    "decode_weight",
    "dtype_name",
    "encode_shard",
    "write_part",
]
