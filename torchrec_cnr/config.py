"""Configuration of a :class:`~torchrec_cnr.CheckpointManager`."""

from __future__ import annotations

from dataclasses import dataclass

from torchrec_cnr.policy import BASELINE_RULES, POLICIES


@dataclass(frozen=True)
class CheckpointConfig:
    """How, where and when to checkpoint.

    Example::

        CheckpointConfig(path="/ckpt/run1", policy="intermittent", interval_steps=500)
    """

    path: str
    """Root directory holding every checkpoint of the run and the chain manifest."""
    policy: str = "intermittent"
    """Row-selection policy: ``full``, ``one_shot``, ``consecutive`` or ``intermittent``."""
    interval_steps: int | None = None
    """``maybe_save(step)`` saves when ``step`` is a positive multiple of this; ``None`` never."""
    baseline_rule: str = "average_write"
    """Rule deciding when ``intermittent`` takes a new baseline (see ``policy.BASELINE_RULES``)."""
    keep_last: int | None = None
    """Keep only what restoring the last N checkpoints needs; ``None`` keeps everything."""

    def __post_init__(self) -> None:
        if not isinstance(self.path, str) or not self.path:
            raise ValueError(f"path must be a non-empty string, got {self.path!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.interval_steps is not None and (
            not isinstance(self.interval_steps, int) or self.interval_steps < 1
        ):
            raise ValueError(
                f"interval_steps must be a positive int or None, got {self.interval_steps!r}"
            )
        if self.baseline_rule not in BASELINE_RULES:
            raise ValueError(
                f"baseline_rule must be one of {sorted(BASELINE_RULES)}, got {self.baseline_rule!r}"
            )
        if self.keep_last is not None and (
            not isinstance(self.keep_last, int) or self.keep_last < 1
        ):
            raise ValueError(f"keep_last must be a positive int or None, got {self.keep_last!r}")
