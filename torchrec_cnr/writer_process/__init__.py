"""The background writer in a process of its own (``background="process"``).

With ``background="thread"`` a checkpoint is encoded, written and committed on threads of
the training process, whose Python work competes with training's for the GIL (on a GPU
host, training needs it to launch every kernel). Here a writer process per rank does that
work (:mod:`.server`), on the shared staging buffers (:mod:`torchrec_cnr.staging.shared`);
the training process copies the lazily staged rows and relays the writer's collectives
(:mod:`.client`). PyTorch's DCP made the same move (``AsyncCheckpointerType.PROCESS``).
Both answer the manager alike (:class:`.inline.Writer`). Its names import on first use
(:mod:`torchrec_cnr.lazy`): the writer process, started as ``python -m
torchrec_cnr.writer_process.server``, imports what it needs and nothing before it.
"""

from typing import TYPE_CHECKING

from torchrec_cnr.lazy import exports, listing

if TYPE_CHECKING:
    from torchrec_cnr.writer_process.client import WriterProcess
    from torchrec_cnr.writer_process.inline import InlineWriter, Writer

__all__ = ["InlineWriter", "Writer", "WriterProcess"]

__getattr__ = exports(
    globals(), {".client": ("WriterProcess",), ".inline": ("InlineWriter", "Writer")}
)
__dir__ = listing(globals())
