"""The chain manifest, read and committed: the versioned contract between save and restore.

One JSON file, ``<root>/manifest.json``, lists every committed checkpoint (its types and
JSON are :mod:`torchrec_cnr.schema`'s). It is replaced atomically (write a temporary
file, fsync, rename, fsync the directory) and only after every rank's data is durable, so
its rename is the commit: a checkpoint directory the manifest does not name does not
exist for a restore.
"""

from __future__ import annotations

import warnings

from torchrec_cnr.errors import ManifestError
from torchrec_cnr.schema import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    PREVIOUS_MANIFEST_NAME,
    DenseInfo,
    Entry,
    ManifestRecord,
    TableShape,
    describe,
    saved_fraction,
)
from torchrec_cnr.storage import PreconditionFailed, Root, Storage, as_storage

__all__ = [
    "FORMAT_VERSION",
    "DenseInfo",
    "Entry",
    "Manifest",
    "TableShape",
    "saved_fraction",
]


class Manifest(ManifestRecord):
    """The manifest of a checkpoint root, read from and committed to its storage."""

    @classmethod
    def load(cls, root: Root, *, fallback: bool = False) -> Manifest:
        """Reads the root's manifest; an empty one if the root has none yet.

        Args:
            root: the root: a :class:`Storage`, a path or a URL.
            fallback: if the manifest is damaged or missing while a previous committed
                manifest exists, use that one (with a warning) instead of failing.

        Raises:
            ManifestError: the manifest is damaged, of another format version, or missing
                while the root shows it had one; the message says whether the previous
                committed manifest is intact.
        """
        storage = as_storage(root)
        where = storage.path(MANIFEST_NAME)
        got = storage.read(MANIFEST_NAME)
        if got is None and not storage.exists(PREVIOUS_MANIFEST_NAME):
            return cls()  # a fresh root
        if got is not None:
            try:
                manifest = cls.parse(got[0], where)
                manifest.version = got[1]
                return manifest
            except ManifestError as e:
                problem = str(e)
        else:
            problem = f"{where} is missing, but the root holds a previous committed manifest"
        previous = cls.previous(storage)
        if previous is not None and fallback:
            warnings.warn(
                f"{problem}; using the previous committed manifest ({describe(previous)})",
                stacklevel=2,
            )
            # The next commit replaces what is there now, damaged or not.
            previous.version = None if got is None else got[1]
            return previous
        hint = (
            f"; the previous committed manifest {PREVIOUS_MANIFEST_NAME} is intact "
            f"({describe(previous)}): CheckpointConfig(manifest_fallback=True) uses it"
            if previous is not None
            else f"; no intact {PREVIOUS_MANIFEST_NAME} to fall back to"
        )
        raise ManifestError(problem + hint)

    @classmethod
    def previous(cls, root: Root) -> Manifest | None:
        """The previous committed manifest, if it exists and is intact."""
        storage = as_storage(root)
        got = storage.read(PREVIOUS_MANIFEST_NAME)
        if got is None:
            return None
        try:
            return cls.parse(got[0], storage.path(PREVIOUS_MANIFEST_NAME))
        except ManifestError:
            return None

    def save(self, storage: Storage) -> None:
        """Commits this manifest in place of the version it was read at.

        The manifest it replaces stays readable as ``manifest.json.prev``, so one damaged
        manifest never loses the chain. The replacement is one atomic, conditional write:
        if another writer changed the manifest since this one was read, nothing changes.

        Raises:
            PreconditionFailed: the manifest is no longer at :attr:`version`.
        """
        current = storage.read(MANIFEST_NAME)
        found = None if current is None else current[1]
        if found != self.version:
            raise PreconditionFailed(
                f"{storage.path(MANIFEST_NAME)} changed since it was read (another writer?)"
            )
        first = current is None and not storage.exists(PREVIOUS_MANIFEST_NAME)
        if current is not None:
            try:
                Manifest.parse(current[0], MANIFEST_NAME)
                storage.write(PREVIOUS_MANIFEST_NAME, current[0])
            except ManifestError:
                pass  # a damaged manifest never replaces the intact previous one
        self.version = storage.write(MANIFEST_NAME, self.to_bytes(), expect=self.version)
        if first:
            # A first commit leaves an empty previous manifest: from now on a missing
            # manifest means a lost one, not a fresh root. It goes after the manifest, so
            # that a reader (a follower) never finds a previous manifest and no manifest.
            storage.write(PREVIOUS_MANIFEST_NAME, Manifest().to_bytes())
