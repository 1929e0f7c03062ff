"""A small sharded DLRM on synthetic Zipf data, for the demo, the tests and the benchmarks.

Batches are a pure function of ``(seed, rank, step)``, so a resumed job sees
exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.distributed.planner.types import (
    KernelConfig,
    Topology,
    TopologyFactory,
    TrainerConfig,
)
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    grid_shard,
    row_wise,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.types import ModuleSharder, ShardingPlan
from torchrec.models.dlrm import DLRM
from torchrec.optim.optimizers import in_backward_optimizer_filter

from torchrec_cnr.tracking import tracking_sharders
from torchrec_cnr.tracking.tracker import TrackingMode

__all__ = [
    "LAYOUTS",
    "Batch",
    "BatchStream",
    "TableSpec",
    "ZipfBatches",
    "build_model",
    "dense_optimizer",
    "hand_plan",
    "planner_topology",
]

LAYOUTS = (
    "table_wise",
    "column_wise",
    "table_column_wise",
    "data_parallel",
    "row_wise",
    "table_row_wise",
    "grid_shard",
)
"""Every TorchRec sharding type; :func:`hand_plan` places any of them on CPU."""


@dataclass(frozen=True)
class TableSpec:
    """One embedding table of the synthetic model."""

    name: str
    rows: int
    dim: int
    sharding: str | None = None
    """Forced sharding type, or ``None`` to let the planner choose."""


@dataclass
class Batch:
    dense: torch.Tensor
    """``(B, num_dense)`` float features."""
    sparse: KeyedJaggedTensor
    labels: torch.Tensor
    """``(B,)`` float 0/1 labels."""

    def to(self, device: torch.device) -> Batch:
        return Batch(self.dense.to(device), self.sparse.to(device), self.labels.to(device))


# Rows of the 26 categorical features of the Criteo Kaggle (Display Advertising
# Challenge) data set, as used by TorchRec's DLRM example.
CRITEO_KAGGLE_CARDINALITIES = (
    1460,
    583,
    10131227,
    2202608,
    305,
    24,
    12517,
    633,
    3,
    93145,
    5683,
    8351593,
    3194,
    27,
    14992,
    5461306,
    10,
    5652,
    2173,
    4,
    7046547,
    18,
    15,
    286181,
    105,
    142572,
)
CRITEO_NUM_DENSE = 13


def criteo_tables(max_rows: int, dim: int, shardings: Sequence[str] = ()) -> list[TableSpec]:
    """The 26 Criteo Kaggle tables, each capped at ``max_rows`` rows."""
    return [
        TableSpec(
            f"cat_{i}",
            min(card, max_rows),
            dim,
            shardings[i % len(shardings)] if shardings else None,
        )
        for i, card in enumerate(CRITEO_KAGGLE_CARDINALITIES)
    ]


class BatchStream(abc.ABC):
    """Training batches that are a pure function of ``(rank, step)``, plus held-out batches.

    Only the position is state, so a stream restored from a checkpoint reads on
    exactly where an uninterrupted one would.
    """

    def __init__(self) -> None:
        self.position = 0

    @abc.abstractmethod
    def batch(self, rank: int, step: int) -> Batch:
        """The batch rank ``rank`` trains on at ``step`` (from 1)."""

    @abc.abstractmethod
    def heldout(self, rank: int, index: int) -> Batch:
        """Held-out batch ``index`` of rank ``rank``, disjoint from training."""

    def _identity(self) -> dict[str, int]:
        """What must match for a checkpointed position to mean the same batches."""
        return {}

    def next(self, rank: int) -> Batch:
        """The next batch in order; the position is part of the state dict."""
        self.position += 1
        return self.batch(rank, self.position)

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, **self._identity()}

    def load_state_dict(self, state: dict[str, int]) -> None:
        mine = self._identity()
        theirs = {k: state[k] for k in mine if k in state}
        if theirs != {k: mine[k] for k in theirs}:
            raise ValueError(f"the checkpoint's data reader had {theirs}, this one has {mine}")
        self.position = int(state["position"])


class ZipfBatches(BatchStream):
    """Deterministic synthetic batches with Zipf-distributed ids and teacher labels.

    Labels come from a planted teacher: a logistic model over the dense
    features and one hidden score per embedding row. A model that learns the
    rows' scores reaches a high AUC, so AUC measures learning.

    Args:
        tables: one feature per table, named ``f_<table>``.
        batch_size: samples per rank per step.
        num_dense: dense features per sample.
        alpha: Zipf exponent; higher concentrates lookups on fewer rows.
        pooling: ids per feature per sample.
        seed: base seed; batches are a pure function of (seed, rank, step).
    """

    def __init__(
        self,
        tables: Sequence[TableSpec],
        batch_size: int,
        num_dense: int = 4,
        alpha: float = 1.1,
        pooling: int = 2,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.tables = list(tables)
        self.batch_size = batch_size
        self.num_dense = num_dense
        self.pooling = pooling
        self.seed = seed
        self._cdfs = []
        self._perms = []
        self._scores = []
        g = torch.Generator().manual_seed(seed)
        for t in self.tables:
            p = 1.0 / torch.arange(1, t.rows + 1, dtype=torch.float64) ** alpha
            self._cdfs.append(torch.cumsum(p / p.sum(), 0))
            # Hot ids are spread over the id space, as hashing does in practice.
            self._perms.append(torch.randperm(t.rows, generator=g))
            self._scores.append(torch.randn(t.rows, generator=g) * (2.0 / len(self.tables)) ** 0.5)
        self._dense_w = torch.randn(num_dense, generator=g) / num_dense**0.5

    def batch(self, rank: int, step: int) -> Batch:
        """The batch rank ``rank`` trains on at ``step``."""
        g = torch.Generator().manual_seed(
            ((self.seed * 1_000_003 + rank) * 1_000_033 + step) % (2**62)
        )
        n = self.batch_size * self.pooling
        ids = []
        logits = torch.zeros(self.batch_size)
        for cdf, perm, score in zip(self._cdfs, self._perms, self._scores):
            u = torch.rand(n, generator=g, dtype=torch.float64)
            picked = perm[torch.searchsorted(cdf, u).clamp_max(len(perm) - 1)]
            ids.append(picked)
            logits += score[picked].view(self.batch_size, self.pooling).mean(1)
        values = torch.cat(ids)
        lengths = torch.full((len(self.tables) * self.batch_size,), self.pooling, dtype=torch.int32)
        sparse = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f_{t.name}" for t in self.tables], values=values, lengths=lengths
        )
        dense = torch.randn(self.batch_size, self.num_dense, generator=g)
        logits += dense @ self._dense_w
        labels = (torch.rand(self.batch_size, generator=g) < torch.sigmoid(2.0 * logits)).float()
        return Batch(dense, sparse, labels)

    def heldout(self, rank: int, index: int) -> Batch:
        # Ranks from 1000 on never train: their stream is held out.
        return self.batch(1000 + rank, index)

    def _identity(self) -> dict[str, int]:
        return {"seed": self.seed}


def hand_plan(
    model: nn.Module,
    layouts: dict[str, str],
    world_size: int,
    sharders: Sequence[ModuleSharder[nn.Module]],
    device_type: str = "cpu",
) -> ShardingPlan:
    """A plan that shards every table of ``model`` with the layout named in ``layouts``.

    TorchRec's CPU planner proposes only data_parallel, table_wise, column_wise and
    table_column_wise, but TorchRec itself shards row_wise, table_row_wise and
    grid_shard on CPU with gloo. Every layout but data_parallel gets the fused kernel,
    so the sharders' ``fused_params`` optimizer trains it, as the planner would choose.
    Table-wise tables go to ranks in turn; the others span all ``world_size`` ranks of
    one host.

    Args:
        model: the unsharded model (embedding modules may be on the meta device).
        layouts: table name -> one of :data:`LAYOUTS`, for every table of every
            module that one of ``sharders`` shards.
        world_size: ranks of the job, all on one host.
        sharders: the sharders that DistributedModelParallel gets.
        device_type: where the tables live (``"cpu"`` or ``"cuda"``).
    """
    plan: dict[str, Any] = {}
    placed = 0
    for path, module in model.named_modules():
        sharder = next((s for s in sharders if type(module) is s.module_type), None)
        if sharder is None:
            continue
        generators = {}
        for name in sharder.shardable_parameters(module):
            layout = layouts[name]
            if layout == "table_wise":
                generators[name] = table_wise(rank=placed % world_size)
                placed += 1
            elif layout in ("column_wise", "table_column_wise"):
                generators[name] = column_wise(ranks=list(range(world_size)))
            elif layout == "data_parallel":
                generators[name] = data_parallel()
            elif layout == "row_wise":
                generators[name] = row_wise()
            elif layout == "table_row_wise":
                generators[name] = table_row_wise(host_index=0)
            elif layout == "grid_shard":
                generators[name] = grid_shard(host_indexes=[0])
            else:
                raise ValueError(f"table {name!r}: layout must be one of {LAYOUTS}, got {layout!r}")
        module_plan = construct_module_sharding_plan(
            module,
            generators,
            sharder=sharder,
            local_size=world_size,
            world_size=world_size,
            device_type=device_type,
        )
        for name, sharding in module_plan.items():
            # TorchRec has no generator for table_column_wise: it is column-wise
            # shards placed within one host, which column_wise() already builds.
            sharding.sharding_type = layouts[name]
            if layouts[name] != "data_parallel":
                sharding.compute_kernel = "fused"
        plan[path] = module_plan
    return ShardingPlan(plan)


def dlrm(
    tables: Sequence[TableSpec],
    num_dense: int,
    tables_device: torch.device,
    dense_device: torch.device,
) -> DLRM:
    """The unsharded DLRM of ``tables``: its embedding tables on ``tables_device`` (``meta``
    for a model about to be sharded), its MLPs on ``dense_device``.

    Raises:
        ValueError: the tables do not share one dim (DLRM's interaction needs it).
    """
    dims = {t.dim for t in tables}
    if len(dims) != 1:
        raise ValueError(f"DLRM needs one embedding dim for every table, got {sorted(dims)}")
    dim = dims.pop()
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name=t.name,
                embedding_dim=t.dim,
                num_embeddings=t.rows,
                feature_names=[f"f_{t.name}"],
            )
            for t in tables
        ],
        device=tables_device,
    )
    return DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=num_dense,
        dense_arch_layer_sizes=[16, dim],
        over_arch_layer_sizes=[16, 1],
        dense_device=dense_device,
    )


def planner_topology(world: int, device: str) -> Topology:
    """TorchRec's planner topology for ``world`` ranks on ``device``, built as TorchRec asks
    (its factory: a ``Topology`` built directly warns that the job will fail)."""
    return TopologyFactory.create_topology(
        TrainerConfig(world_size=world), kernel_config=KernelConfig(compute_device=device)
    )


def build_model(
    tables: Sequence[TableSpec],
    num_dense: int = 4,
    device: torch.device | None = None,
    learning_rate: float = 0.05,
    seed: int = 0,
    pg: dist.ProcessGroup | None = None,
    tracking: bool = True,
    tracking_mode: TrackingMode = "bitmap",
    fused_params: dict[str, Any] | None = None,
) -> DistributedModelParallel:
    """A DLRM sharded over ``pg`` with a fused optimizer (row-wise Adagrad unless
    ``fused_params`` name another).

    Every table must have the same ``dim`` (DLRM's interaction needs it). Tables that all
    name a sharding are placed by :func:`hand_plan`, the others by TorchRec's planner.
    ``tracking=False`` uses TorchRec's own sharders (for benchmarks).
    """
    device = device or torch.device("cpu")
    torch.manual_seed(seed)
    module = dlrm(tables, num_dense, torch.device("meta"), device)
    fused = fused_params or {
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        "learning_rate": learning_rate,
    }
    sharders = (
        tracking_sharders(fused, mode=tracking_mode)
        if tracking
        else [EmbeddingBagCollectionSharder(fused_params=fused)]
    )
    pg = pg or dist.GroupMember.WORLD
    world = dist.get_world_size(pg)
    if all(t.sharding for t in tables):
        layouts = {t.name: str(t.sharding) for t in tables}
        plan = hand_plan(module, layouts, world, sharders, device.type)
    else:
        constraints = {
            t.name: ParameterConstraints(sharding_types=[t.sharding]) for t in tables if t.sharding
        }
        topology = planner_topology(world, device.type)
        plan = EmbeddingShardingPlanner(topology=topology, constraints=constraints).collective_plan(
            module, sharders, pg
        )
    model = DistributedModelParallel(module, plan=plan, sharders=sharders, device=device)
    # Sharded tables are initialised by their kernels from the global RNG; seed again
    # per rank so that two builds with one seed are identical.
    torch.manual_seed(seed + 1)
    return model


def dense_optimizer(model: nn.Module, lr: float = 0.05) -> torch.optim.Optimizer:
    """Adagrad over the parameters the fused optimizer does not own."""
    params = [p for _, p in in_backward_optimizer_filter(model.named_parameters())]
    return torch.optim.Adagrad(params, lr=lr)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch) -> float:
    """One step of BCE training; the fused optimizer updates rows during backward."""
    optimizer.zero_grad()
    logits = model(batch.dense, batch.sparse).squeeze(-1)
    loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
    loss.backward()
    optimizer.step()
    return float(loss.detach())
