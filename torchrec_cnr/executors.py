"""The thread pools a checkpoint's work runs on, owned by whoever creates them.

A :class:`~torchrec_cnr.CheckpointManager` creates one :class:`Executors` from its
``IOOptions`` and shuts it down in ``close()``; a model-free read creates its own for
the read's duration. Nothing in the library keeps a pool of its own beyond that.

I/O and encoding are apart: I/O threads mostly wait (in ``pwrite``, in a socket), so
there are many; quantization is CPU-bound, so there are as many threads as cores. Each
encoding thread keeps its quantizer scratch buffers (thread-local) for reuse, and they
go with the thread when the pool shuts down.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

__all__ = ["Executors"]


class Executors:
    """An I/O pool and an encoding pool.

    Args:
        io_threads: threads that read and write objects.
        encode_threads: threads that quantize rows.
        object_bytes: the largest data object written, and the most one read request reads.
    """

    def __init__(self, io_threads: int, encode_threads: int, object_bytes: int) -> None:
        self.io = ThreadPoolExecutor(io_threads, thread_name_prefix="cnr-io")
        self.encode = ThreadPoolExecutor(encode_threads, thread_name_prefix="cnr-encode")
        self.object_bytes = object_bytes

    def close(self) -> None:
        """Waits for the work in flight and stops every thread."""
        self.encode.shutdown(wait=True)
        self.io.shutdown(wait=True)

    def __enter__(self) -> Executors:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
