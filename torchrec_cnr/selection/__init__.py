"""Stage 2: which rows a checkpoint holds. Policies, baseline rules, CPR's prioritized rows."""

from torchrec_cnr.selection.policy import (
    BASELINE_RULES,
    POLICIES,
    ChainState,
    Decision,
    Policy,
    register_baseline_rule,
)

__all__ = [
    "BASELINE_RULES",
    "POLICIES",
    "ChainState",
    "Decision",
    "Policy",
    "register_baseline_rule",
]
