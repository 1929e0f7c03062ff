"""Names inside a checkpoint root: checkpoint directories and the tensors each holds.

A root holds the chain manifest and one torchsnapshot snapshot per checkpoint::

    ROOT/manifest.json
    ROOT/000000-step0000000500/
        <rank>/rows/<name>    a shard's stored tensors (see torchrec_cnr.encoding.codec)
        dense/<name>          replicated tensors, written once (read as 0/dense/<name>)
        <rank>/app/blob       the rank's app_state, serialized
"""

from __future__ import annotations

__all__ = ["MANIFEST_NAME", "app_path", "checkpoint_id", "dense_path", "rows_path"]

MANIFEST_NAME = "manifest.json"


def checkpoint_id(seq: int, step: int) -> str:
    """Directory name of a checkpoint; unique even when a step is saved twice."""
    return f"{seq:06d}-step{step:010d}"


def rows_path(rank: int, name: str) -> str:
    """Logical path of a shard tensor ``name`` written by ``rank``."""
    return f"{rank}/rows/{name}"


def dense_path(name: str) -> str:
    """Logical path of a replicated dense tensor."""
    return f"0/dense/{name}"


def app_path(rank: int) -> str:
    """Logical path of ``rank``'s serialized app_state."""
    return f"{rank}/app/blob"
