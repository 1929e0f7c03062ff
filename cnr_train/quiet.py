"""Silences third-party warnings that a user of the training job cannot act on.

TorchRec, FBGEMM and PyTorch warn about their own deprecations and internals on every
rank (a deprecated DDP argument TorchRec passes, an FBGEMM module that fails to import
an SSD kernel, autograd fallbacks inside FBGEMM ops). The library never filters
warnings; the application does, before it imports them. Set ``CNR_VERBOSE=1`` to see
everything.
"""

from __future__ import annotations

import logging
import os
import warnings

__all__ = ["quiet_third_party"]

_MESSAGES = (
    r".*`broadcast_buffers` is deprecated.*",
    r".*`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated.*",
    r".*an autograd kernel was not registered to the Autograd key.*",
    r".*Failed to import: fbgemm_gpu.*",
    r".*fbgemm_gpu\.split_table_batched_embeddings_ops is now DEPRECATED.*",
    r".*`torch\.jit\.script` is deprecated.*",
    r".*TypedStorage is deprecated.*",
)
_LOGGERS = (
    "torchrec.distributed.utils",
    "torchrec.distributed.comm",
    "torchrec.distributed.planner",
    "torch.fx._symbolic_trace",
)
_ROOT_MESSAGES = ("Could not determine LOCAL_WORLD_SIZE",)


class _DropRootNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(m in record.getMessage() for m in _ROOT_MESSAGES)


def quiet_third_party() -> None:
    """Installs the filters; call it before importing torch, TorchRec or FBGEMM."""
    if os.environ.get("CNR_VERBOSE") == "1":
        return
    for pattern in _MESSAGES:
        warnings.filterwarnings("ignore", message=pattern)
    for name in _LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger().addFilter(_DropRootNoise())
