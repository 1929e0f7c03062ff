"""Stage 6: reading committed checkpoints, shared by every use of them: a chain's
records and tensors (``chain``), where saved rows land in another shard (``geometry``),
a table's rows without a model (``tables``), reads planned as frozen items (``items``) and
carried out under one memory budget that the process's reads share (``plan``), and a read
again when retention or compaction retires a checkpoint while it is read, or past a
damaged one (``retry``). Restores, compaction, the offline tools, the DCP export and the
serving follower read through it.
"""

from torchrec_cnr.read.chain import ChainReader, find_ids, missing_step
from torchrec_cnr.read.items import MemoryBudget, ReadItem, ReadPlan, held_by_reads
from torchrec_cnr.read.plan import Held, carry_out
from torchrec_cnr.read.retry import Intact, load_committed, load_newest_intact

__all__ = [
    "ChainReader",
    "Held",
    "Intact",
    "MemoryBudget",
    "ReadItem",
    "ReadPlan",
    "carry_out",
    "find_ids",
    "held_by_reads",
    "load_committed",
    "load_newest_intact",
    "missing_step",
]
