"""A committed checkpoint read again if it was retired while read.

A checkpoint can vanish under a reader: another job's ``keep_last`` retires it, or
compaction replaces its chain, between reading the manifest and reading the files. Then
the read fails with :class:`~torchrec_cnr.errors.CheckpointReadError` before anything
changed, and :func:`load_committed` reads what the manifest names now. Only when the
manifest still names the very checkpoint that failed is the error real. The manager's
``restore()`` and the serving follower both load through it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from torchrec_cnr.commit.manifest import Entry, Manifest
from torchrec_cnr.errors import CheckpointReadError
from torchrec_cnr.read.chain import missing_step

__all__ = ["ATTEMPTS", "load_committed"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

ATTEMPTS = 8
"""Reads of a step before a checkpoint that keeps being retired counts as unreadable."""


def load_committed(
    manifest: Callable[[], Manifest],
    step: int | None,
    load: Callable[[Manifest, Entry], T],
    url: str,
) -> tuple[Entry, T] | None:
    """``load(manifest, entry)`` of the committed checkpoint of ``step`` (the latest if
    ``None``), read again from a fresh ``manifest()`` if it was retired while read.

    Returns:
        The entry loaded and what ``load`` returned; ``None`` if ``step`` is ``None`` and
        the root holds no checkpoint.

    Raises:
        ValueError: no committed checkpoint has ``step``.
        CheckpointReadError: the checkpoint is unreadable (and still committed).
    """
    for attempt in range(ATTEMPTS):
        current = manifest()
        entry = current.find(step)
        if entry is None:
            if step is None:
                return None
            raise missing_step(current, step, url)
        try:
            return entry, load(current, entry)
        except CheckpointReadError:
            now = manifest().find(step)
            # By id: an entry's records are read lazily, and a retired one's are gone.
            if attempt == ATTEMPTS - 1 or (now is not None and now.id == entry.id):
                raise
            logger.warning("checkpoint %s was retired while read; reading again", entry.id)
    raise AssertionError("unreachable")
