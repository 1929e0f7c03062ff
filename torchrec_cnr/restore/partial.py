"""CPR's partial recovery (Maeng et al., MLSys'21, Sec. 3): which shards reload.

Only the failed ranks' shards, or only some tables, reload their last checkpoint; every
other shard keeps its live state and training goes on from the current step.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torchrec_cnr.tracking.shard import LocalShard

__all__ = ["RestoreScope", "select_shards"]


@dataclass(frozen=True)
class RestoreScope:
    """Which shards a restore reloads: every one, or (CPR's partial recovery) those of
    some ranks or some tables."""

    ranks: list[int] | None = None
    """Reload only the shards these ranks hold; every rank's if ``None``."""
    tables: list[str] | None = None
    """Reload only these tables, by short or qualified name; every table if ``None``."""

    @property
    def partial(self) -> bool:
        """Only some shards reload: dense tensors, ``app_state``, the kernels' step counters
        and the live chain keep their live values."""
        return self.ranks is not None or self.tables is not None


def select_shards(
    shards: list[LocalShard],
    rank: int,
    world_size: int,
    scope: RestoreScope,
    known_tables: Iterable[str],
) -> list[LocalShard]:
    """This rank's shards that a restore limited to ``scope`` reloads.

    Args:
        shards: this rank's shards.
        rank: this rank.
        world_size: ranks of the job.
        scope: the ranks and tables to reload.
        known_tables: every table of the model (qualified names), over all ranks.

    Raises:
        ValueError: a rank outside the job, or a table the model does not have.
    """
    ranks, tables = scope.ranks, scope.tables
    if ranks is not None:
        bad = [r for r in ranks if not 0 <= r < world_size]
        if bad:
            raise ValueError(f"ranks {bad} are outside 0..{world_size - 1}")
    known = sorted(known_tables)
    wanted: set[str] | None = None
    if tables is not None:
        short = {name.rsplit(".", 1)[-1]: name for name in known}
        unknown = [t for t in tables if t not in known and t not in short]
        if unknown:
            raise ValueError(f"tables {unknown} are not in the model; tables: {known}")
        wanted = {short.get(t, t) for t in tables}
    if ranks is not None and rank not in ranks:
        return []
    return [s for s in shards if wanted is None or s.spec.table in wanted]
