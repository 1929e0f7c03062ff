"""The exceptions a user of torchrec_cnr can meet, in one place.

Every one takes a single message, so that the rank that failed can send it and every
other rank can raise the same type with the same text (see :mod:`torchrec_cnr.collectives`).
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointReadError",
    "ChecksumError",
    "ManifestError",
    "ModelMismatchError",
]


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the previous committed one stays the restore target."""


class ManifestError(ValueError):
    """The chain manifest is missing, corrupt, or of an unknown format."""


class CheckpointReadError(RuntimeError):
    """A committed checkpoint's files are missing, unreadable or corrupt."""


class ChecksumError(CheckpointReadError):
    """A stored tensor's bytes do not match the checksum recorded at save time."""


class ModelMismatchError(ValueError):
    """The checkpoint was written by a model with other tables or dense tensors."""
