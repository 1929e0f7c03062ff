"""A committed checkpoint read again if it was retired while read, or, on request, the
newest intact one where the latest is damaged.

A checkpoint can vanish under a reader: another job's ``keep_last`` retires it, or
compaction replaces its chain, between reading the manifest and reading the files. Then
the read fails with :class:`~torchrec_cnr.errors.CheckpointReadError` before anything
changed, and :func:`load_committed` reads what the manifest names now. Only when the
manifest still names the very checkpoint that failed is the error real. The manager's
``restore()`` and the serving follower both load through it.

A real error on the latest checkpoint ends the restore, unless the job asked to read past
it (``CheckpointConfig(on_damaged="fall_back")``): :func:`load_newest_intact` then loads the
newest checkpoint before it whose chain loads, passing over every one whose chain holds
the damaged link.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from torchrec_cnr.errors import CheckpointReadError, ManifestError, UnsafeObjectError
from torchrec_cnr.manifest import Manifest, Summary
from torchrec_cnr.read.chain import missing_step

__all__ = ["ATTEMPTS", "Intact", "load_committed", "load_newest_intact"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

ATTEMPTS = 8
"""Reads of a step before a checkpoint that keeps being retired counts as unreadable."""


def load_committed(
    manifest: Callable[[], Manifest],
    step: int | None,
    load: Callable[[Manifest, Summary], T],
    url: str,
) -> tuple[Summary, T] | None:
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


@dataclass(frozen=True)
class Intact(Generic[T]):
    """What :func:`load_newest_intact` loaded, and what it passed over."""

    entry: Summary
    loaded: T
    passed: list[Summary]
    """The newer checkpoints that did not load, newest first."""
    damaged: list[str]
    """The links found damaged: every passed checkpoint's chain holds one."""
    error: CheckpointReadError | None
    """Why the latest did not load."""


def _damaged_link(manifest: Manifest, entry: Summary, error: CheckpointReadError) -> str:
    # A read error names the file it failed on, under its checkpoint's directory.
    text = str(error)
    try:
        chain = manifest.chain(entry)
    except (CheckpointReadError, ManifestError):  # a record its chain walks is the damage
        chain = [i for i in (entry.parent, entry.id) if i is not None]
    return next((i for i in reversed(chain) if i in text), entry.id)


def load_newest_intact(
    manifest: Callable[[], Manifest], load: Callable[[Manifest, Summary], T], url: str
) -> Intact[T] | None:
    """``load`` of the latest committed checkpoint (see :func:`load_committed`); where it
    fails on a damaged file, of the newest checkpoint before it that loads. A checkpoint
    whose chain holds a link found damaged is passed over unread.

    ``load`` must change nothing when it raises (a restore verifies before it applies).

    Returns:
        What loaded; ``None`` if the root holds no checkpoint.

    Raises:
        CheckpointReadError: no committed checkpoint loads (the latest's error).
        UnsafeObjectError: as ``load`` raised it (a type ``safe_globals`` lacks: not damage).
    """
    try:
        loaded = load_committed(manifest, None, load, url)
    except UnsafeObjectError:
        raise
    except CheckpointReadError as first:
        current = manifest()
        newest = current.latest()
        assert newest is not None
        passed, damaged = [newest], [_damaged_link(current, newest, first)]
        for entry in reversed(current.checkpoints[:-1]):
            try:
                if not any(link in damaged for link in current.chain(entry)):
                    return Intact(entry, load(current, entry), passed, damaged, first)
            except UnsafeObjectError:
                raise
            except CheckpointReadError as e:
                damaged.append(_damaged_link(current, entry, e))
            passed.append(entry)
        raise
    return None if loaded is None else Intact(loaded[0], loaded[1], [], [], None)
