"""The manifest in a room of its own, below the write side (:mod:`torchrec_cnr.commit`)
and every reader (:mod:`torchrec_cnr.read`, restores, the follower, the catalog): its
records as data (:mod:`.records`) and the manifest read from and committed to a root
(:mod:`.store`)."""

from torchrec_cnr.manifest.records import DenseInfo, Entry, Summary, TableShape, saved_fraction
from torchrec_cnr.manifest.store import Keep, Manifest
from torchrec_cnr.schema import FORMAT_VERSION

__all__ = [
    "FORMAT_VERSION",
    "DenseInfo",
    "Entry",
    "Keep",
    "Manifest",
    "Summary",
    "TableShape",
    "saved_fraction",
]
