"""The exceptions a user of torchrec_cnr can meet, in one place.

Every one derives from :class:`CnrError`, so ``except CnrError`` catches whatever the
library raises on purpose; each also keeps the built-in base it always had
(``RuntimeError`` or ``ValueError``), so code that catches those still does.

Checkpointing is collective: when one rank fails, every rank raises (see
:meth:`torchrec_cnr.collectives.Collective.agree`). The failing rank raises its own
error; the others raise the same type with a message naming that rank, and carry the
failing rank's traceback text as :attr:`CnrError.remote_traceback` and as the
exception's ``__cause__``.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointReadError",
    "ChecksumError",
    "CnrError",
    "ManifestError",
    "ModelMismatchError",
    "RemoteTraceback",
    "UnsafeObjectError",
]


class CnrError(Exception):
    """The base of every exception torchrec_cnr defines."""

    rank: int | None = None
    """The rank that failed, when this error was raised on its behalf by another rank."""
    remote_traceback: str | None = None
    """That rank's traceback, as text."""


class RemoteTraceback(CnrError):
    """The traceback of a failure on another rank, attached as the ``__cause__`` of the
    error this rank raises for it; its message is the traceback text."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class CheckpointError(CnrError, RuntimeError):
    """A checkpoint could not be written; the previous committed one stays the restore target."""


class ManifestError(CnrError, ValueError):
    """The chain manifest is missing, corrupt, or of an unknown format."""


class CheckpointReadError(CnrError, RuntimeError):
    """A committed checkpoint's files are missing, unreadable or corrupt."""


class ChecksumError(CheckpointReadError):
    """A stored tensor's bytes do not match the checksum recorded at save time."""


class ModelMismatchError(CnrError, ValueError):
    """The checkpoint was written by a model with other tables or dense tensors."""


class UnsafeObjectError(CheckpointReadError):
    """A pickled object in a checkpoint names a type or function a restore may not load
    (see ``CheckpointConfig.safe_globals``); nothing of it ran."""
