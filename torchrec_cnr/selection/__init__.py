"""Stage 2: which rows a checkpoint holds. Policies, baseline rules, CPR's prioritized rows."""

from torchrec_cnr.selection.policy import (
    BASELINE_RULES,
    POLICIES,
    BaselineRule,
    ChainState,
    Decision,
    Policy,
    check_policy,
)

__all__ = [
    "BASELINE_RULES",
    "POLICIES",
    "ChainState",
    "Decision",
    "BaselineRule",
    "Policy",
    "check_policy",
]
