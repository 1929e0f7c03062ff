"""The exceptions a user of torchrec_cnr can meet, in one place.

Every one derives from :class:`CnrError`, so ``except CnrError`` catches whatever the
library raises on purpose; each also keeps the built-in base it always had
(``RuntimeError`` or ``ValueError``), so code that catches those still does.

Checkpointing is collective: when one rank fails, every rank raises the same error (see
:meth:`torchrec_cnr.collectives.Collective.agree`): the failing rank's type, a message
naming that rank (``on rank N: ...``), ``rank`` set to N and ``remote_traceback`` to its
traceback text. An error that wraps it on its way up (a ``CheckpointError`` from the
background writer, say) keeps both (:func:`wrapping`).
"""

from __future__ import annotations

from typing import TypeVar

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
    """The rank that failed, when every rank raised this error for a collective failure
    (the failing rank too); ``None`` for an error of this rank alone."""
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


def brief(e: BaseException) -> str:
    """``e`` in a line, for a message that names it: a decoding error says where it failed,
    not the whole input it holds (a damaged file's every byte)."""
    if isinstance(e, UnicodeDecodeError):
        return f"UnicodeDecodeError: not {e.encoding} at byte {e.start} ({e.reason})"
    text = repr(e)
    return text if len(text) <= 300 else text[:300] + "..."


E = TypeVar("E", bound=BaseException)


def wrapping(error: E, cause: BaseException) -> E:
    """``error`` raised because of ``cause``, as its ``__cause__``, keeping the failing
    rank and traceback that ``cause`` (or an error it came from) carries: ``raise
    wrapping(CheckpointError(...), e)``."""
    found: BaseException | None = cause
    while found is not None and getattr(found, "rank", None) is None:
        found = found.__cause__
    if found is not None:
        error.rank = found.rank  # type: ignore[attr-defined]
        error.remote_traceback = found.remote_traceback  # type: ignore[attr-defined]
    error.__cause__ = cause
    return error
