"""CPR: partial recovery and the checkpoint interval it allows."""

from torchrec_cnr.recovery.interval import IntervalDecision, choose_interval, pls, young_interval

__all__ = ["IntervalDecision", "choose_interval", "pls", "young_interval"]
