"""CPR (Maeng et al., MLSys'21): the checkpoint interval and recovery mode, and the probe
that measures what they need. Partial restores are in :mod:`torchrec_cnr.restore.partial`,
prioritized rows in :mod:`torchrec_cnr.selection.priority`. :class:`SaveSchedule` decides
at each step whether a job saves."""

from torchrec_cnr.recovery.interval import IntervalDecision, choose_interval, pls, young_interval
from torchrec_cnr.recovery.probe import IntervalProbe
from torchrec_cnr.recovery.schedule import SaveSchedule

__all__ = [
    "IntervalDecision",
    "IntervalProbe",
    "SaveSchedule",
    "choose_interval",
    "pls",
    "young_interval",
]
