"""Row-selection policies: which rows each checkpoint holds and what a restore needs.

Check-N-Run (Eisenman et al., NSDI'22, Sec. 4.3). Let S_i be the size of the i-th delta
since the last full baseline, as a fraction of a full checkpoint.

- ``full``: every checkpoint holds every row.
- ``one_shot``: a baseline, then each checkpoint holds every row modified since
  it. A restore needs the baseline and the latest delta.
- ``consecutive``: each checkpoint holds the rows modified since the previous
  one. A restore needs the baseline and every delta, in order.
- ``intermittent``: ``one_shot`` that starts a new baseline whenever the
  baseline rule says so; the default rule is Check-N-Run's
  ``1 + S_1 + ... + S_i <= (i + 1) * S_i``.

A policy is pure logic over a :class:`ChainState`; the manager applies it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from torchrec_cnr.schema import Kind

__all__ = [
    "BASELINE_RULES",
    "KINDS",
    "POLICIES",
    "ChainState",
    "Decision",
    "Kind",
    "Policy",
    "PolicyName",
    "average_write_rule",
    "check_policy",
]

PolicyName = Literal["full", "one_shot", "consecutive", "intermittent"]
POLICIES: tuple[PolicyName, ...] = ("full", "one_shot", "consecutive", "intermittent")
KINDS: tuple[Kind, ...] = ("full", "delta")

BaselineRule = Callable[[Sequence[float]], bool]
"""Takes S_1..S_i since the baseline; returns True to make the next checkpoint a baseline."""


def average_write_rule(sizes: Sequence[float]) -> bool:
    """Check-N-Run's rule: a new baseline once the latest delta is as large as
    the average write per interval since the baseline."""
    if not sizes:
        return False
    i = len(sizes)
    return 1.0 + sum(sizes) <= (i + 1) * sizes[-1]


BASELINE_RULES: Mapping[str, BaselineRule] = MappingProxyType({"average_write": average_write_rule})
"""The built-in rules, by name; ``CheckpointConfig(baseline_rule=...)`` also takes your own
function."""


def check_policy(name: str, baseline_rule: str | BaselineRule) -> BaselineRule:
    """Checks a policy name and a baseline rule (a name in :data:`BASELINE_RULES` or a
    function); returns the rule's function.

    Raises:
        ValueError: an unknown policy or rule name.
    """
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {name!r}")
    if callable(baseline_rule):
        return baseline_rule
    if baseline_rule not in BASELINE_RULES:
        raise ValueError(
            f"baseline_rule must be one of {sorted(BASELINE_RULES)} or a function, "
            f"got {baseline_rule!r}"
        )
    return BASELINE_RULES[baseline_rule]


@dataclass
class ChainState:
    """Where the chain stands after the last committed checkpoint."""

    chain: list[str] = field(default_factory=list)
    """Checkpoint ids a restore of the last checkpoint applies, baseline first."""
    sizes: list[float] = field(default_factory=list)
    """S_1..S_i of the deltas since the baseline (kept by ``intermittent`` only, which
    decides from them)."""


@dataclass(frozen=True)
class Decision:
    """What the next checkpoint is."""

    kind: Kind
    """``"full"`` or ``"delta"``."""
    clear_bits: bool
    """Whether the modified-row bits restart from zero once this checkpoint is staged."""


class Policy:
    """Decides the kind of each checkpoint and the chain that restores it.

    Args:
        name: one of :data:`POLICIES`.
        baseline_rule: a name in :data:`BASELINE_RULES` or a function, used by
            ``intermittent``.
    """

    def __init__(
        self, name: PolicyName, baseline_rule: str | BaselineRule = "average_write"
    ) -> None:
        self._rule = check_policy(name, baseline_rule)
        self.name = name

    @property
    def cumulative(self) -> bool:
        """Whether each delta holds every row modified since the baseline (one-shot and
        intermittent), rather than since the previous checkpoint."""
        return self.name in ("one_shot", "intermittent")

    def decide(self, state: ChainState) -> Decision:
        """The kind of the next checkpoint, given the chain so far."""
        full = (
            not state.chain
            or self.name == "full"
            or (self.name == "intermittent" and self._rule(state.sizes))
        )
        if full:
            return Decision("full", clear_bits=True)
        return Decision("delta", clear_bits=self.name == "consecutive")

    def advance(
        self, state: ChainState, decision: Decision, ckpt_id: str, size: float
    ) -> ChainState:
        """The chain after committing checkpoint ``ckpt_id`` of relative size ``size``."""
        if decision.kind == "full":
            return ChainState([ckpt_id], [])
        sizes = [*state.sizes, size] if self.name == "intermittent" else []
        if self.name == "consecutive":
            return ChainState([*state.chain, ckpt_id], sizes)
        return ChainState([state.chain[0], ckpt_id], sizes)
