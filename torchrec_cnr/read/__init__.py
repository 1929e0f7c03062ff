"""Stage 7: reading committed checkpoints, shared by every use of them: a chain's
records and tensors (``chain``), where saved rows land in another shard (``geometry``),
a table's rows without a model (``tables``), and a read again when retention or
compaction retires a checkpoint while it is read (``retry``). Restores, compaction, the
offline tools, the DCP export and the serving follower read through it.
"""

from torchrec_cnr.read.chain import ChainReader, find_ids, missing_step
from torchrec_cnr.read.retry import load_committed

__all__ = ["ChainReader", "find_ids", "load_committed", "missing_step"]
