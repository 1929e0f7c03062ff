"""CPR's interval formulas against hand-computed values."""

from __future__ import annotations

import math

import pytest

from torchrec_cnr.recovery import choose_interval, pls, young_interval


def test_pls_matches_hand_computed_value() -> None:
    # 30-minute saves, 10-hour MTBF, 8 shards: 1800 / (2 * 36000 * 8) = 0.003125
    assert pls(1800, 36_000, 8) == pytest.approx(0.003125)


def test_young_interval_matches_hand_computed_value() -> None:
    # sqrt(2 * 60 s * 36000 s) = sqrt(4.32e6) = 2078.46 s
    assert young_interval(60, 36_000) == pytest.approx(2078.4609, rel=1e-6)


def test_partial_recovery_is_chosen_when_its_overhead_is_lower() -> None:
    d = choose_interval(
        mtbf_s=36_000,
        num_shards=8,
        pls_target=0.01,
        save_cost_s=60,
        load_cost_s=120,
        reschedule_s=300,
    )
    # partial: T = 2 * 36000 * 8 * 0.01 = 5760 s; 60/5760 + (120/8 + 300)/36000 = 0.0104167 + 0.00875
    assert d.partial_interval_s == pytest.approx(5760)
    assert d.partial_overhead == pytest.approx(60 / 5760 + 315 / 36_000)
    # full: T* = 2078.46; 60/T* + (T*/2 + 120 + 300)/36000
    t = math.sqrt(2 * 60 * 36_000)
    assert d.full_overhead == pytest.approx(60 / t + (t / 2 + 420) / 36_000)
    assert d.mode == "partial" and d.interval_s == d.partial_interval_s
    assert d.pls == pytest.approx(0.01)


def test_full_recovery_is_chosen_when_the_pls_target_forces_tiny_intervals() -> None:
    d = choose_interval(mtbf_s=3600, num_shards=2, pls_target=1e-4, save_cost_s=30, load_cost_s=10)
    # partial interval 2 * 3600 * 2 * 1e-4 = 1.44 s: saving every 1.44 s costs 20x the training time
    assert d.partial_interval_s == pytest.approx(1.44)
    assert d.mode == "full" and d.interval_s == pytest.approx(math.sqrt(2 * 30 * 3600))


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"pls_target": 0}, "pls_target"),
        ({"mtbf_s": -1}, "mtbf"),
        ({"num_shards": 0}, "num_shards"),
        ({"save_cost_s": 0}, "save_cost"),
    ],
)
def test_invalid_inputs_are_rejected_naming_the_field(kwargs: dict, field: str) -> None:
    args = {
        "mtbf_s": 3600,
        "num_shards": 2,
        "pls_target": 0.01,
        "save_cost_s": 1,
        "load_cost_s": 1,
        **kwargs,
    }
    with pytest.raises(ValueError, match=field):
        choose_interval(**args)
