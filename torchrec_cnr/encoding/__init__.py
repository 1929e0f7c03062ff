"""Stage 4: storage formats, per-row quantization of each table, checksums."""

from torchrec_cnr.encoding.checksum import (
    as_bytes,
    check,
    crc32,
    crc32_bytes,
    crc32_combine,
    mismatch,
)
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
    "as_bytes",
    "check",
    "crc32",
    "crc32_bytes",
    "crc32_combine",
    "decode_weight",
    "encode_shard",
    "mismatch",
]
