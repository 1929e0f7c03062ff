"""Policy decisions and the intermittent baseline rule, as pure logic."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from torchrec_cnr.selection.policy import (
    ChainState,
    Policy,
    average_write_rule,
)


def _run(policy: Policy, sizes: list[float]) -> list[tuple[str, bool, list[str]]]:
    state = ChainState()
    out: list[tuple[str, bool, list[str]]] = []
    for n, size in enumerate(sizes):
        d = policy.decide(state)
        state = policy.advance(state, d, f"c{n}", size)
        out.append((d.kind, d.clear_bits, list(state.chain)))
    return out


def test_full_policy_always_writes_a_lone_baseline() -> None:
    assert _run(Policy("full"), [1, 1, 1]) == [
        ("full", True, ["c0"]),
        ("full", True, ["c1"]),
        ("full", True, ["c2"]),
    ]


def test_one_shot_chain_is_baseline_plus_latest_delta_and_keeps_bits() -> None:
    assert _run(Policy("one_shot"), [1, 0.1, 0.2, 0.3]) == [
        ("full", True, ["c0"]),
        ("delta", False, ["c0", "c1"]),
        ("delta", False, ["c0", "c2"]),
        ("delta", False, ["c0", "c3"]),
    ]


def test_consecutive_chain_grows_with_every_increment_and_clears_bits() -> None:
    assert _run(Policy("consecutive"), [1, 0.1, 0.1]) == [
        ("full", True, ["c0"]),
        ("delta", True, ["c0", "c1"]),
        ("delta", True, ["c0", "c1", "c2"]),
    ]


def test_average_write_rule_matches_hand_computed_cases() -> None:
    # i=1: 1 + S1 <= 2 S1  <=>  S1 >= 1
    assert not average_write_rule([0.99])
    assert average_write_rule([1.0])
    # i=3, S=(0.2, 0.4, 0.7): 1 + 1.3 = 2.3 <= 4 * 0.7 = 2.8
    assert average_write_rule([0.2, 0.4, 0.7])
    # i=3, S=(0.2, 0.4, 0.5): 2.1 <= 2.0 is false
    assert not average_write_rule([0.2, 0.4, 0.5])
    assert not average_write_rule([])


def test_intermittent_takes_a_new_baseline_when_the_rule_fires() -> None:
    kinds = [k for k, _, _ in _run(Policy("intermittent"), [1, 0.2, 0.4, 0.7, 0.1, 0.1])]
    assert kinds == ["full", "delta", "delta", "delta", "full", "delta"]


def test_baseline_rule_is_pluggable() -> None:
    def every_third(sizes: Sequence[float]) -> bool:
        return len(sizes) >= 2

    kinds = [k for k, _, _ in _run(Policy("intermittent", every_third), [1, 0.1, 0.1, 1, 0.1])]
    assert kinds == ["full", "delta", "delta", "full", "delta"]


def test_unknown_policy_and_rule_are_rejected_with_allowed_values() -> None:
    with pytest.raises(ValueError, match="policy must be one of .*'full'"):
        Policy("sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="baseline_rule must be one of"):
        Policy("intermittent", "nope")
