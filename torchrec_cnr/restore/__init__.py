"""Stage 7: applying a chain to a live model, compatibility checks, partial recovery, verify."""

from torchrec_cnr.restore.apply import ChainRead, apply_chain, read_chain
from torchrec_cnr.restore.compat import check_compatible
from torchrec_cnr.restore.partial import select_shards
from torchrec_cnr.restore.restore import restore_entry
from torchrec_cnr.restore.verify import verify_chains, verify_checkpoint

__all__ = [
    "ChainRead",
    "apply_chain",
    "check_compatible",
    "read_chain",
    "restore_entry",
    "select_shards",
    "verify_chains",
    "verify_checkpoint",
]
