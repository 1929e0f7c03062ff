"""Choosing the checkpoint interval (CPR, Maeng et al., MLSys'21, Sec. 4.2).

With N embedding shards, a mean time between failures ``T_fail`` (of the job:
any failure) that each hits one shard, and a save interval ``T_save``, a
failure loses on average half an interval of updates on one shard in N, so the
portion of lost samples is

    PLS = T_save / (2 * T_fail * N).

Partial recovery keeps PLS under a target by saving every
``T_save = 2 * T_fail * N * PLS_target``. Full recovery instead picks Young's
optimum ``T* = sqrt(2 * O_save * T_fail)`` and pays lost computation. Expected
overhead, as a fraction of training time:

- full: ``O_save / T* + (T* / 2 + O_load + O_resched) / T_fail``
- partial: ``O_save / T_save + (O_load_partial + O_resched) / T_fail``

Partial recovery is chosen when its overhead is lower. All times in seconds.
"""

from __future__ import annotations

import math

from torchrec_cnr.schema import IntervalDecision


def pls(save_interval_s: float, mtbf_s: float, num_shards: int) -> float:
    """Expected portion of lost samples with partial recovery."""
    _check_positive(save_interval=save_interval_s, mtbf=mtbf_s, num_shards=num_shards)
    return save_interval_s / (2.0 * mtbf_s * num_shards)


def young_interval(save_cost_s: float, mtbf_s: float) -> float:
    """Young's optimal checkpoint interval for full recovery: ``sqrt(2 * O_save * T_fail)``."""
    _check_positive(save_cost=save_cost_s, mtbf=mtbf_s)
    return math.sqrt(2.0 * save_cost_s * mtbf_s)


def choose_interval(
    *,
    mtbf_s: float,
    num_shards: int,
    pls_target: float,
    save_cost_s: float,
    load_cost_s: float,
    partial_load_cost_s: float | None = None,
    reschedule_s: float = 0.0,
) -> IntervalDecision:
    """Picks partial or full recovery and its checkpoint interval.

    Args:
        mtbf_s: mean time between failures of the job.
        num_shards: embedding shards a failure may hit (one per failure).
        pls_target: largest acceptable portion of lost samples, in (0, 1).
        save_cost_s: training time a checkpoint costs (measured in this job).
        load_cost_s: time a full restore costs.
        partial_load_cost_s: time restoring one shard costs; ``load_cost_s / num_shards`` if None.
        reschedule_s: time to replace a failed node.
    """
    _check_positive(mtbf=mtbf_s, num_shards=num_shards, save_cost=save_cost_s)
    if not 0 < pls_target < 1:
        raise ValueError(f"pls_target must be in (0, 1), got {pls_target}")
    if load_cost_s < 0 or reschedule_s < 0:
        raise ValueError("load_cost_s and reschedule_s must be >= 0")
    partial_load = load_cost_s / num_shards if partial_load_cost_s is None else partial_load_cost_s
    t_partial = 2.0 * mtbf_s * num_shards * pls_target
    t_full = young_interval(save_cost_s, mtbf_s)
    partial = save_cost_s / t_partial + (partial_load + reschedule_s) / mtbf_s
    full = save_cost_s / t_full + (t_full / 2.0 + load_cost_s + reschedule_s) / mtbf_s
    mode = "partial" if partial < full else "full"
    return IntervalDecision(
        mode=mode,
        interval_s=t_partial if mode == "partial" else t_full,
        partial_interval_s=t_partial,
        full_interval_s=t_full,
        partial_overhead=partial,
        full_overhead=full,
        pls=pls(t_partial, mtbf_s, num_shards),
    )


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
