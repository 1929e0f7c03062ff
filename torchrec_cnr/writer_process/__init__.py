"""The background writer in a process of its own (``background="process"``).

With ``background="thread"`` a checkpoint is encoded, written and committed on threads of
the training process, whose Python work competes with training's for the GIL (on a GPU
host, training needs it to launch every kernel). Here a writer process per rank does that
work (:mod:`.server`), on the shared staging buffers (:mod:`torchrec_cnr.staging.shared`);
the training process copies the lazily staged rows and relays the writer's collectives
(:mod:`.client`). PyTorch's DCP made the same move (``AsyncCheckpointerType.PROCESS``).
Both answer the manager alike (:class:`.inline.Writer`).
"""

from torchrec_cnr.writer_process.client import WriterProcess
from torchrec_cnr.writer_process.inline import InlineWriter, Writer

__all__ = ["InlineWriter", "Writer", "WriterProcess"]
