"""The TorchRec models the tests train beside the app's DLRM, their batches, and the
bit-for-bit comparison of a rank's whole state (:func:`capture`, :func:`differences`).

- ``ebc``: TorchRec's own ``TestSparseNN`` with an EmbeddingBagCollection and a
  weighted EmbeddingBagCollection (id-score-list features), each holding a table of
  every layout: two sharded modules in one model.
- ``ec``: a sequence model on an EmbeddingCollection (unpooled embeddings), with every
  layout TorchRec's EmbeddingCollection sharder supports.

Row-wise tables have 4001 rows, so their blocks differ in size. Batches are a pure
function of ``(rank, step)``, so a resumed run sees the batches of an uninterrupted one.
:func:`tests.jobs.make_job` builds jobs on them.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    CounterBasedRegularizationDefinition,
    CounterWeightDecayMode,
    WeightDecayMode,
)
from torch import nn
from torchrec import EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_tracker.types import DeltaTrackerConfig
from torchrec.distributed.test_utils.test_model import ModelInput, TestSparseNN
from torchrec.distributed.types import ShardingEnv
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from cnr_train.workload import LAYOUTS, hand_plan
from torchrec_cnr import tracking_sharders
from torchrec_cnr.tracking import model_state

DIM = 16
NUM_FLOAT = 8
BATCH = 8

OPTIMIZERS: dict[str, dict[str, Any]] = {
    "exact_sgd": {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1},
    "exact_adagrad": {"optimizer": EmbOptimType.EXACT_ADAGRAD, "learning_rate": 0.05},
    "exact_rowwise_adagrad": {
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        "learning_rate": 0.05,
    },
    # Counter weight decay keeps prev_iter and row_counter per row and reads the TBE's
    # step counter: the CPU stand-in for the optimizers whose step FBGEMM counts on CUDA.
    "rowwise_adagrad_counter": {
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        "learning_rate": 0.05,
        "weight_decay": 0.01,
        "weight_decay_mode": WeightDecayMode.COUNTER,
        "counter_based_regularization": CounterBasedRegularizationDefinition(
            counter_weight_decay_mode=CounterWeightDecayMode.DECOUPLE, counter_halflife=2
        ),
    },
    # As TorchRec's tutorials set it: the optimizer on the parameters, no fused_params.
    "in_backward_rowwise_adagrad": {},
}
"""Fused optimizers FBGEMM runs on CPU, by case name -> the sharders' fused_params."""

MODEL_LAYOUTS = {
    "ebc": LAYOUTS,
    # TorchRec's EmbeddingCollectionSharder also offers data_parallel, but TorchRec 1.8's
    # data-parallel EmbeddingCollection returns pooled rows on CPU and fails in forward.
    "ec": ("table_wise", "column_wise", "row_wise"),
}


def _rows(layout: str) -> int:
    return 4001 if "row" in layout or layout == "grid_shard" else 301


class SequenceModel(nn.Module):
    """Sums each sample's sequence embeddings over an EmbeddingCollection, then an MLP."""

    def __init__(self, tables: list[EmbeddingConfig], device: torch.device) -> None:
        super().__init__()
        self.ec = EmbeddingCollection(tables=tables, device=device)
        self.dense = nn.Linear(NUM_FLOAT, DIM)
        self.over = nn.Linear(DIM, 1)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        hidden = self.dense(dense)
        for jt in self.ec(sparse).values():
            sample = torch.repeat_interleave(
                torch.arange(len(jt.lengths())), jt.lengths(), output_size=jt.values().shape[0]
            )
            hidden = hidden.index_add(0, sample, jt.values())
        return self.over(torch.relu(hidden)).squeeze(-1)


class TorchRecBatches:
    """The ``kind`` model's batches: a pure function of ``(rank, step)``."""

    def __init__(self, kind: str, tables: list[Any], weighted: list[Any]) -> None:
        self.kind, self.tables, self.weighted = kind, tables, weighted
        self.position = 0
        """The step of the last batch trained on (the job's, not saved)."""

    def batch(self, rank: int, step: int) -> Any:
        world = dist.get_world_size()
        with torch.random.fork_rng():
            if self.kind == "ebc":
                _, local = ModelInput.generate(
                    batch_size=BATCH,
                    world_size=world,
                    num_float_features=NUM_FLOAT,
                    tables=self.tables,
                    weighted_tables=self.weighted,
                    pooling_avg=3,
                    random_seed=step,
                )
                return local[rank]
            g = torch.Generator().manual_seed(step * 64 + rank)
            lengths = torch.randint(0, 4, (len(self.tables) * BATCH,), generator=g)
            ids = [
                torch.randint(0, t.num_embeddings, (int(n),), generator=g)
                for t, n in zip(self.tables, lengths.view(len(self.tables), BATCH).sum(1))
            ]
            sparse = KeyedJaggedTensor.from_lengths_sync(
                keys=[t.feature_names[0] for t in self.tables],
                values=torch.cat(ids),
                lengths=lengths,
            )
            dense = torch.randn(BATCH, NUM_FLOAT, generator=g)
            labels = (torch.rand(BATCH, generator=g) < 0.5).float()
            return dense, sparse, labels

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        if self.kind == "ebc":
            loss, _ = model(batch)
            return loss  # type: ignore[no-any-return]
        dense, sparse, labels = batch
        logits = model(dense, sparse)
        return nn.functional.binary_cross_entropy_with_logits(logits, labels)


def _configs(config: Any, kind: str, name: str, feature: str) -> list[Any]:
    """A table config of class ``config`` per layout of ``kind``'s model: ``<name><layout>``,
    fed by feature ``<feature><layout>``."""
    return [
        config(
            name=f"{name}{layout}",
            embedding_dim=DIM,
            num_embeddings=_rows(layout),
            feature_names=[f"{feature}{layout}"],
        )
        for layout in MODEL_LAYOUTS[kind]
    ]


def unsharded(kind: str, device: str = "meta") -> tuple[nn.Module, list[Any], list[Any]]:
    """The ``kind`` model before sharding, with its table configs (tables, weighted ones).

    ``device="cpu"`` gives a model to load an exported state dict into.
    """
    weighted: list[Any] = []
    if kind == "ebc":
        config = EmbeddingBagConfig
        weighted = _configs(EmbeddingBagConfig, kind, "w_", "wf_")
    else:
        config = EmbeddingConfig
    tables = _configs(config, kind, "t_", "f_")
    if kind == "ebc":
        module: nn.Module = TestSparseNN(
            tables=tables,
            weighted_tables=weighted,
            num_float_features=NUM_FLOAT,
            sparse_device=torch.device(device),
        )
    else:
        module = SequenceModel(tables, torch.device(device))
    return module, tables, weighted


def sharded(
    kind: str,
    optimizer: str,
    layouts: dict[str, str] | None = None,
    dtensor: bool = False,
    delta_tracker: bool = False,
) -> tuple[DistributedModelParallel, TorchRecBatches]:
    """The ``kind`` model sharded on the current process group, and its batches.

    Args:
        kind: ``ebc`` or ``ec``.
        optimizer: a key of :data:`OPTIMIZERS`.
        layouts: table name -> layout, overriding each table's own (for resharding).
        dtensor: its state dict holds DTensors (TorchRec's ``output_dtensor``) rather
            than ShardedTensors.
        delta_tracker: shard with TorchRec's own sharders and turn TorchRec's delta tracker
            on (ids only, read by the manager as its consumer) instead of the library's
            sharders.
    """
    fused = OPTIMIZERS[optimizer]
    module, tables, weighted = unsharded(kind)
    sparse: Any = module.sparse if kind == "ebc" else module
    sparse_modules = [sparse.ebc, sparse.weighted_ebc] if kind == "ebc" else [sparse.ec]
    if not fused:
        for m in sparse_modules:
            apply_optimizer_in_backward(RowWiseAdagrad, m.parameters(), {"lr": 0.05})
    placed = {t.name: t.name.split("_", 1)[1] for t in [*tables, *weighted]}
    placed.update(layouts or {})
    sharders: list[Any] = tracking_sharders(fused or None)
    if delta_tracker:
        sharders = [EmbeddingBagCollectionSharder(fused_params=fused or None),
                    EmbeddingCollectionSharder(fused_params=fused or None)]  # fmt: skip
    plan = hand_plan(module, placed, dist.get_world_size(), sharders)
    env = ShardingEnv(dist.get_world_size(), dist.get_rank(), dist.group.WORLD, dtensor)
    model = DistributedModelParallel(
        module, env=env, plan=plan, sharders=sharders, device=torch.device("cpu")
    )
    if delta_tracker:
        model.init_torchrec_delta_tracker(DeltaTrackerConfig(consumers=["torchrec_cnr"]))
    return model, TorchRecBatches(kind, tables, weighted)


def capture(model: nn.Module, app_state: dict[str, Any]) -> dict[str, Any]:
    """A copy of everything the contract compares: every local shard's weights, fused
    optimizer states and step counters, the dense state and ``app_state``."""
    shards = {}
    for s in model_state.local_shards(model):
        key = f"{s.spec.table}@{s.spec.row_offset},{s.spec.col_offset}"
        shards[key] = {
            "weight": s.weight.detach().clone(),
            "states": {k: v.detach().clone() for k, v in s.states.items()},
            "scalars": s.scalar_states(),
            "optimizer": s.optimizer,
        }
    dense = {k: v.detach().clone() for k, v in model_state.dense_state(model).items()}
    app = {k: copy.deepcopy(v.state_dict()) for k, v in app_state.items()}
    return {"shards": shards, "dense": dense, "app": app}


def differences(want: Any, got: Any, where: str = "") -> list[str]:
    """Every place where two captures differ, bit for bit (dtype included)."""
    if isinstance(want, torch.Tensor):
        same = (
            isinstance(got, torch.Tensor)
            and want.dtype == got.dtype
            and want.shape == got.shape
            and torch.equal(want, got)
        )
        return [] if same else [where]
    if isinstance(want, dict):
        if not isinstance(got, dict) or want.keys() != got.keys():
            return [
                f"{where}: keys {sorted(want)} != {sorted(got) if isinstance(got, dict) else got}"
            ]
        return [d for k in want for d in differences(want[k], got[k], f"{where}.{k}")]
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(want) != len(got):
            return [where]
        return [
            d for i, (a, b) in enumerate(zip(want, got)) for d in differences(a, b, f"{where}[{i}]")
        ]
    return [] if want == got else [f"{where}: {want!r} != {got!r}"]
