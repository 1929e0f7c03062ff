"""Stage 4: storage formats, per-row quantization of each table, checksums."""

from torchrec_cnr.encoding.checksum import check, crc32, crc32_bytes
from torchrec_cnr.encoding.codec import (
    EncodedShard,
    ShardRecord,
    StateInfo,
    decode_weight,
    encode_shard,
)
from torchrec_cnr.encoding.formats import FP32, Format, FormatResolver

__all__ = [
    "FP32",
    "EncodedShard",
    "Format",
    "FormatResolver",
    "ShardRecord",
    "StateInfo",
    "check",
    "crc32",
    "crc32_bytes",
    "decode_weight",
    "encode_shard",
]
