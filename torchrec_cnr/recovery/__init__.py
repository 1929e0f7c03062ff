"""CPR (Maeng et al., MLSys'21): the checkpoint interval and recovery mode, and the probe
that measures what they need. Partial restores are in :mod:`torchrec_cnr.restore.partial`,
prioritized rows in :mod:`torchrec_cnr.selection.priority`."""

from torchrec_cnr.recovery.interval import IntervalDecision, choose_interval, pls, young_interval
from torchrec_cnr.recovery.probe import IntervalProbe

__all__ = ["IntervalDecision", "IntervalProbe", "choose_interval", "pls", "young_interval"]
