"""Stage 7: loading a committed chain into a live model, compatibility checks, partial
recovery, verify; a restore whole even when a signal arrives while it changes the model
(``signals``). It reads through :mod:`torchrec_cnr.read` (the chain reader, where saved
rows land, the retry when a checkpoint is retired while read).
"""

from torchrec_cnr.restore.apply import PreparedRestore, ReadOptions, apply_chain, read_chain
from torchrec_cnr.restore.collective import LocalModel, load_app_state, restore_entry
from torchrec_cnr.restore.compat import check_compatible, check_serving
from torchrec_cnr.restore.loader import ModelLoader, Restored
from torchrec_cnr.restore.partial import RestoreScope, select_shards
from torchrec_cnr.restore.signals import DeferredSignals
from torchrec_cnr.restore.verify import verify_chains, verify_checkpoint

__all__ = [
    "DeferredSignals",
    "LocalModel",
    "ModelLoader",
    "PreparedRestore",
    "ReadOptions",
    "RestoreScope",
    "Restored",
    "apply_chain",
    "check_compatible",
    "check_serving",
    "load_app_state",
    "read_chain",
    "restore_entry",
    "select_shards",
    "verify_chains",
    "verify_checkpoint",
]
