"""Stage 7: loading a committed chain into a live model (with a retry when it is retired while
read, shared with the serving follower), compatibility checks, partial recovery, verify.

``geometry`` is the one rule of where saved rows land in another shard; ``chain`` the one
way a chain is read. Both also serve compaction and model-free reads (``offline``).
"""

from torchrec_cnr.restore.apply import PreparedRestore, apply_chain, read_chain
from torchrec_cnr.restore.chain import ChainReader
from torchrec_cnr.restore.compat import check_compatible, check_serving
from torchrec_cnr.restore.loader import ModelLoader, Restored, load_committed
from torchrec_cnr.restore.partial import select_shards
from torchrec_cnr.restore.restore import load_app_state, restore_entry
from torchrec_cnr.restore.verify import verify_chains, verify_checkpoint

__all__ = [
    "ChainReader",
    "ModelLoader",
    "PreparedRestore",
    "Restored",
    "apply_chain",
    "check_compatible",
    "check_serving",
    "load_committed",
    "load_app_state",
    "read_chain",
    "restore_entry",
    "select_shards",
    "verify_chains",
    "verify_checkpoint",
]
