"""Stand-ins for the names the documented code leaves to the reader, declared once per page.

A page's Python blocks use names their prose defines in words: ``module`` (an unsharded
TorchRec model), ``reader`` (a data reader), ``train_step``, ``dmp``, ``root``. Each
``@standin(page, run)`` function below defines them for one run of the page's blocks
(see :mod:`tests.docs.markdown`) and may return a check, run after the blocks, that
looks at what they did. The names are real objects built the way a user builds them:
TorchRec's ``TestSparseNN`` (or the app's DLRM, ``kind="dlrm"``), sharded by TorchRec's
planner over the ranks ``torchrun`` started, trained by a loop of the documented shape.

The documented paths stay as written and are mapped into the test's folder:
``/ckpt/...`` -> ``<tmp>/ckpt/...`` (:func:`localize`), ``s3://bucket/...`` is a bucket
of the tests' moto server. ``/ckpt/run1`` (and ``s3://bucket/run1``) holds a root
trained to step 500 with a checkpoint every 100 steps, ``/ckpt/dcp/step_500`` TorchRec's
DCP recipe of step 500, ``/ckpt/snap_500`` torchsnapshot's snapshot of it
(:func:`make_trained`).
"""

from __future__ import annotations

import hashlib
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec import EmbeddingBagConfig
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.test_utils.test_model import ModelInput, TestSparseNN
from torchrec.optim.optimizers import in_backward_optimizer_filter

import torchrec_cnr
from cnr_train import workload
from torchrec_cnr.offline import list_checkpoints

TABLES = {"t_user": 41_000, "t_item": 2000, "t_ad": 1000, "t_geo": 500}
"""Table -> rows: the names the pages use; ``t_user`` holds row 40,000 (docs/offline.md)."""
DIM = 16
NUM_FLOAT = 8
BATCH = 16
TRAINED = 500
EVERY = 100
BUCKET = "bucket"


@dataclass(frozen=True)
class Env:
    """Where and on what a run's blocks run."""

    tmp: str
    """The page's folder: ``/ckpt/...`` maps to ``<tmp>/ckpt/...``."""
    kind: str = "testsparsenn"
    """The model: TorchRec's ``TestSparseNN``, or ``dlrm`` (the app's DLRM)."""
    fixtures: str = ""
    """The folder of the trained fixtures, one per kind (:func:`make_trained`)."""
    out: str = ""
    """Where a check may leave a file for the test (a digest, say)."""

    def path(self, documented: str) -> str:
        return localize(documented, self.tmp)

    def trained(self, kind: str) -> str:
        return f"{self.fixtures}/{kind}"


def localize(text: str, tmp: str) -> str:
    """``text`` with the documented absolute paths mapped into ``tmp``."""
    return text.replace("/ckpt/", f"{tmp}/ckpt/")


Check = Callable[[dict[str, Any]], None]
Setup = Callable[[Env, dict[str, Any]], Check | None]
_SETUPS: dict[tuple[str, str], Setup] = {}


def standin(page: str, run: str) -> Callable[[Setup], Setup]:
    """Registers the stand-ins of ``run`` on ``page``."""

    def register(fn: Setup) -> Setup:
        _SETUPS[(page, run)] = fn
        return fn

    return register


def begin(page: str, run: str, env: Env, ns: dict[str, Any]) -> Callable[[], None]:
    """Defines the run's stand-ins in ``ns`` (the generated script's globals); returns
    what the script calls after the blocks."""
    check = _SETUPS[(page, run)](env, ns)

    def end() -> None:
        if check is not None:
            check(ns)

    return end


def has_standin(page: str, run: str) -> bool:
    return (page, run) in _SETUPS


# -- the model, its data and its training step, as a user has them ------------------


def unsharded(kind: str, device: str = "meta") -> nn.Module:
    """The model before sharding (tables on ``device``; ``cpu`` for serving)."""
    torch.manual_seed(0)
    if kind == "dlrm":
        specs = [workload.TableSpec(name, rows, DIM) for name, rows in TABLES.items()]
        return workload.dlrm(specs, 4, torch.device(device), torch.device("cpu"))
    tables, weighted = _configs()
    return TestSparseNN(
        tables=tables,
        weighted_tables=weighted,
        num_float_features=NUM_FLOAT,
        sparse_device=torch.device(device),
    )


def _configs() -> tuple[list[EmbeddingBagConfig], list[EmbeddingBagConfig]]:
    tables = [
        EmbeddingBagConfig(name=n, embedding_dim=DIM, num_embeddings=r, feature_names=[f"f_{n}"])
        for n, r in TABLES.items()
    ]
    weighted = [
        EmbeddingBagConfig(
            name="w_click", embedding_dim=DIM, num_embeddings=300, feature_names=["wf_click"]
        )  # fmt: skip
    ]
    return tables, weighted


FUSED = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}


def sharded(kind: str) -> DistributedModelParallel:
    """The model sharded over the default group by TorchRec's planner, as the README does."""
    module = unsharded(kind)
    sharders = torchrec_cnr.tracking_sharders(FUSED)
    world = dist.get_world_size()
    planner = EmbeddingShardingPlanner(topology=workload.planner_topology(world, "cpu"))
    plan = planner.collective_plan(module, sharders, dist.group.WORLD)
    model = DistributedModelParallel(module, plan=plan, sharders=sharders,
                                     device=torch.device("cpu"))  # fmt: skip
    return model


def dense_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """Adam over the parameters the fused optimizer does not train."""
    return torch.optim.Adam(dict(in_backward_optimizer_filter(model.named_parameters())).values(),
                            lr=1e-3)  # fmt: skip


class Reader:
    """A data reader: batches by ``(rank, position)``, its position in its state dict."""

    def __init__(self, kind: str) -> None:
        self.kind, self.position = kind, 0
        self.zipf = workload.ZipfBatches(
            [workload.TableSpec(n, r, DIM) for n, r in TABLES.items()], batch_size=BATCH
        )

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        self.position += 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        if self.kind == "dlrm":
            return self.zipf.batch(rank, self.position)
        tables, weighted = _configs()
        with torch.random.fork_rng():
            _, local = ModelInput.generate(
                batch_size=BATCH, world_size=1, num_float_features=NUM_FLOAT, tables=tables,
                weighted_tables=weighted, pooling_avg=3, random_seed=self.position * 64 + rank,
            )  # fmt: skip
        return local[0]

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def loss_of(kind: str, model: nn.Module, batch: Any) -> torch.Tensor:
    """The model's loss on ``batch`` (forward only)."""
    if kind == "dlrm":
        logits = model(batch.dense, batch.sparse).squeeze(-1)
        return nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
    loss, _ = model(batch)
    return loss


def step_fn(kind: str, ns: dict[str, Any], optimizer_name: str) -> Callable[..., float]:
    """``train_step(model, batch)``: forward, backward (the fused optimizer updates the
    rows), then the dense optimizer the run's code named ``optimizer_name``."""

    def train_step(model: nn.Module, batch: Any) -> float:
        opt = ns[optimizer_name]
        opt.zero_grad()
        loss = loss_of(kind, model, batch)
        loss.backward()
        opt.step()
        return float(loss.detach())

    return train_step


class Saved(Protocol):
    """What a digest takes of a data reader: its state dict (:class:`Reader`'s, or a
    trainer job's reader's)."""

    def state_dict(self) -> dict[str, Any]: ...


def digest(model: DistributedModelParallel, dense_opt: torch.optim.Optimizer, reader: Saved) -> str:
    """One rank's whole training state, hashed: its shards of every table and fused
    optimizer state, the dense parameters, the dense optimizer and the reader."""
    h = hashlib.sha256()
    for tree in (model.state_dict(), model.fused_optimizer.state_dict(),
                 dense_opt.state_dict(), reader.state_dict()):  # fmt: skip
        _hash(h, tree)
    return h.hexdigest()


def model_digest(model: DistributedModelParallel) -> str:
    """This rank's shards of every table and fused optimizer state, and the dense state."""
    h = hashlib.sha256()
    for tree in (model.state_dict(), model.fused_optimizer.state_dict()):
        _hash(h, tree)
    return h.hexdigest()


def _hash(h: Any, tree: Any) -> None:
    """Adds ``tree`` (a state dict, this rank's part of each sharded tensor) to ``h``."""
    if hasattr(tree, "local_shards"):  # a ShardedTensor: this rank's part
        for shard in tree.local_shards():
            _hash(h, shard.tensor)
    elif isinstance(tree, torch.Tensor):
        h.update(tree.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    elif isinstance(tree, dict):
        for key in sorted(tree, key=str):
            h.update(str(key).encode())
            _hash(h, tree[key])
    elif isinstance(tree, list | tuple):
        for item in tree:
            _hash(h, item)
    else:
        h.update(repr(tree).encode())


def make_trained(tmp: str, kind: str) -> None:
    """On every rank: trains to step 500 with a checkpoint every 100 steps into
    ``/ckpt/run1``, then saves step 500 as TorchRec's DCP recipe (``/ckpt/dcp/step_500``)
    and as torchsnapshot's snapshot (``/ckpt/snap_500``)."""
    import torch.distributed.checkpoint as dcp
    import torchsnapshot

    model = sharded(kind)
    opt, reader = dense_optimizer(model), Reader(kind)
    train_step = step_fn(kind, {"opt": opt}, "opt")
    config = torchrec_cnr.CheckpointConfig(path=localize("/ckpt/run1", tmp), policy="intermittent",
                                           interval_steps=EVERY)  # fmt: skip
    with torchrec_cnr.CheckpointManager(model, config, {"reader": reader, "dense_opt": opt}) as c:
        for step in range(1, TRAINED + 1):
            train_step(model, next(reader))
            c.maybe_save(step)
    recipe = {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict(),
              "dense_opt": opt.state_dict()}  # fmt: skip
    dcp.save(recipe, checkpoint_id=localize("/ckpt/dcp/step_500", tmp))
    torchsnapshot.Snapshot.take(localize("/ckpt/snap_500", tmp), {"model": model, "dense_opt": opt})


def upload(folder: Path, url: str) -> None:
    """Copies a local folder to ``s3://bucket/prefix`` (the environment's endpoint)."""
    import boto3

    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    client = boto3.client("s3")
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder)}")


# -- the pages' runs ----------------------------------------------------------------


def _s3_copy(env: Env, kind: str) -> None:
    """``s3://bucket/run1``: a copy of the ``kind`` model's trained root."""
    import boto3

    client = boto3.client("s3")
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix="run1/").get("Contents", [])
    for item in listed:
        client.delete_object(Bucket=BUCKET, Key=item["Key"])
    upload(Path(env.trained(kind)) / "ckpt" / "run1", f"s3://{BUCKET}/run1")


def _restored_manager(env: Env, ns: dict[str, Any]) -> None:
    """A live job on ``/ckpt/run1``, restored to its latest step: ``ckpt`` and its parts."""
    _live_job(env, ns, ("model", "dense_optimizer", "reader"))
    config = torchrec_cnr.CheckpointConfig(path=env.path("/ckpt/run1"), interval_steps=EVERY)
    app = {"reader": ns["reader"], "dense_opt": ns["dense_optimizer"]}
    ns["ckpt"] = torchrec_cnr.CheckpointManager(ns["model"], config, app)
    assert ns["ckpt"].restore() is not None
    ns["failed_rank"] = 1


def _live_job(env: Env, ns: dict[str, Any], names: tuple[str, str, str]) -> None:
    """``names`` = (model, dense optimizer, reader): a sharded model, its dense optimizer
    and its data reader, under the page's names."""
    model = sharded(env.kind)
    ns[names[0]], ns[names[1]], ns[names[2]] = model, dense_optimizer(model), Reader(env.kind)


def _close(name: str) -> Check:
    def check(ns: dict[str, Any]) -> None:
        ns[name].close()

    return check


def _killing(
    train_step: Callable[..., float], reader: Reader, ns: dict[str, Any], out: str
) -> Callable[..., float]:
    """``train_step`` that SIGKILLs rank 1 at the step after ``DOCS_TEST_KILL_AFTER`` in a
    job's first attempt: right after ``maybe_save`` of that step returned, while its
    checkpoint commits in the background. Just before, with ``out``, each rank writes the
    digest of its state then (:func:`digest`; the reader at the step trained last) to
    ``<out>.<rank>.uninterrupted``: the state of a job that never stopped, at that step."""
    after = int(os.environ.get("DOCS_TEST_KILL_AFTER", "0"))

    def step(model: nn.Module, batch: Any) -> float:
        first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if after and reader.position == after + 1 and first:
            if out:
                reader.position = after  # next() moved it to this step's batch, untrained
                state = digest(ns["model"], ns["dense_optimizer"], reader)
                reader.position = after + 1
                Path(f"{out}.{dist.get_rank()}.uninterrupted").write_text(state)
            if dist.get_rank() == 1:
                print(f"rank 1 SIGKILLed after the save of step {after}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        return train_step(model, batch)

    return step


@standin("README.md", "quickstart")
def _readme_quickstart(env: Env, ns: dict[str, Any]) -> Check:
    reader = Reader(env.kind)
    ns.update(
        module=unsharded(env.kind),
        device=torch.device("cpu"),
        reader=reader,
        train_step=_killing(step_fn(env.kind, ns, "dense_optimizer"), reader, ns, env.out),
        num_steps=int(os.environ.get("DOCS_TEST_STEPS", TRAINED + EVERY)),
    )

    def check(ns: dict[str, Any]) -> None:
        # The quick start ends restored to step 200: this rank's whole state, for a test
        # that compares a run killed and resumed with one that never stopped.
        state = digest(ns["model"], ns["dense_optimizer"], ns["reader"])
        if env.out:
            Path(f"{env.out}.{dist.get_rank()}").write_text(state)
        ns["ckpt"].close()
        dist.destroy_process_group()

    return check


@standin("README.md", "after-failure")
def _readme_after_failure(env: Env, ns: dict[str, Any]) -> Check:
    _restored_manager(env, ns)

    def check(ns: dict[str, Any]) -> None:
        ns["ckpt"].close()
        assert ns["weights"].shape == (TABLES["t_user"], DIM)
        assert ns["state_dict"]["sparse.ebc.embedding_bags.t_user.weight"].equal(ns["weights"])

    return check


@standin("README.md", "serving")
def _readme_serving(env: Env, ns: dict[str, Any]) -> Check:
    _s3_copy(env, "dlrm")  # served(dense, sparse): the DLRM's forward
    batch = workload.ZipfBatches(
        [workload.TableSpec(n, r, DIM) for n, r in TABLES.items()], batch_size=BATCH
    ).batch(0, 1)
    ns.update(unsharded_model=unsharded("dlrm", "cpu"), dense=batch.dense, sparse=batch.sparse)

    def check(ns: dict[str, Any]) -> None:
        assert ns["follower"].step == TRAINED and ns["scores"].shape[0] == BATCH

    return check


@standin("docs/user-guide.md", "saving")
def _guide_saving(env: Env, ns: dict[str, Any]) -> Check:
    _live_job(env, ns, ("model", "dense_optimizer", "reader"))
    ns.update(train_step=step_fn(env.kind, ns, "dense_optimizer"), num_steps=TRAINED + EVERY)
    return _close("ckpt")


@standin("docs/user-guide.md", "safe-globals")
def _guide_safe_globals(env: Env, ns: dict[str, Any]) -> None:
    ns["root"] = env.path("/ckpt/run1")


@standin("docs/user-guide.md", "background-process")
def _guide_background_process(env: Env, ns: dict[str, Any]) -> Check:
    _live_job(env, ns, ("model", "dense_optimizer", "reader"))
    ns["train_step"] = step_fn(env.kind, ns, "dense_optimizer")

    def check(ns: dict[str, Any]) -> None:  # the writer process committed every checkpoint
        steps = [c.step for c in list_checkpoints(env.path("/ckpt/fresh"))]
        assert steps == [10, 20, 30], steps
        assert ns["ckpt"].writer_pid is not None

    return check


@standin("docs/user-guide.md", "hand-plan")
def _guide_hand_plan(env: Env, ns: dict[str, Any]) -> Check:
    ns.update(module=unsharded(env.kind), world=dist.get_world_size())

    def check(ns: dict[str, Any]) -> None:  # it trains
        model = ns["model"]
        step_fn(env.kind, {"opt": dense_optimizer(model)}, "opt")(model, next(Reader(env.kind)))

    return check


@standin("docs/cpr.md", "partial")
def _cpr_partial(env: Env, ns: dict[str, Any]) -> Check:
    _restored_manager(env, ns)
    return _close("ckpt")


@standin("docs/launching.md", "launcher")
def _launching(env: Env, ns: dict[str, Any]) -> None:
    def train() -> None:
        total = torch.ones(1)
        dist.all_reduce(total)
        assert total.item() == dist.get_world_size() == int(os.environ["WORLD_SIZE"])

    ns["train"] = train


@standin("docs/launching.md", "damaged")
def _launching_damaged(env: Env, ns: dict[str, Any]) -> Check:
    root = env.path("/ckpt/run1")
    if dist.get_rank() == 0:
        damage_latest(root)
    dist.barrier()
    _live_job(env, ns, ("model", "dense_optimizer", "reader"))
    ns.update(train_step=step_fn(env.kind, ns, "dense_optimizer"), num_steps=TRAINED + EVERY)

    def check(ns: dict[str, Any]) -> None:
        assert ns["start"] == TRAINED - EVERY
        steps = [c.step for c in list_checkpoints(root)]
        assert steps[-2:] == [TRAINED, TRAINED + EVERY] and steps.count(TRAINED) == 2, steps

    return check


def damage_latest(root: str) -> None:
    """Flips a byte of the first stored rows of the root's latest checkpoint."""
    import json

    from torchrec_cnr.storage import open_storage

    storage = open_storage(root)
    latest = list_checkpoints(root)[-1]
    got = storage.read(f"{latest.id}/.snapshot_metadata")
    assert got is not None
    stored = next(
        v
        for k, v in sorted(json.loads(got[0])["manifest"].items())
        if "/rows/" in k and "byte_range" in v
    )
    name = f"{latest.id}/{stored['location']}"
    data = storage.read(name)
    assert data is not None
    flipped = bytearray(data[0])
    flipped[sum(stored["byte_range"]) // 2] ^= 0xFF
    storage.write(name, bytes(flipped))


@standin("docs/configuration.md", "torchtitan")
def _configuration_torchtitan(env: Env, ns: dict[str, Any]) -> Check:
    def check(ns: dict[str, Any]) -> None:  # the same config as in our names
        ours = torchrec_cnr.CheckpointConfig(
            path=env.path("/ckpt/titan"), interval_steps=500, keep_last=3,
            exclude_from_loading=("reader",), background="thread",
        )  # fmt: skip
        assert ns["config"] == ours

    return check


@standin("docs/storage.md", "fsspec-options")
def _storage_fsspec_options(env: Env, ns: dict[str, Any]) -> Check:
    def check(ns: dict[str, Any]) -> None:  # the options reach the store as given
        from torchrec_cnr.storage.remote import FsspecStorage

        config = ns["config"]
        assert config.path.startswith("gs://") and config.storage_options["project"] == "my-project"
        opened = FsspecStorage(config.path, {"token": "anon", "project": "my-project"})
        assert opened.fs.project == "my-project" and opened.protocol == "gs"
        assert ns["follower_options"].storage_options["token"] == "anon"

    return check


@standin("docs/entry-points.md", "torchtnt")
def _entry_torchtnt(env: Env, ns: dict[str, Any]) -> Check:
    from torchtnt.framework.unit import TrainUnit

    _live_job(env, ns, ("model", "dense_optimizer", "reader"))
    train_step = step_fn(env.kind, ns, "dense_optimizer")

    class Unit(TrainUnit[Any]):
        def train_step(self, state: Any, data: Any) -> None:
            train_step(ns["model"], data)

    ns["unit"] = Unit()

    def check(ns: dict[str, Any]) -> None:  # a checkpoint every 10 steps, the last 3 kept
        steps = [c.step for c in list_checkpoints(env.path("/ckpt/tnt"))]
        assert steps[-3:] == [10, 20, 30] and ns["reader"].position == 30, steps

    return check


@standin("docs/entry-points.md", "lightning")
def _entry_lightning(env: Env, ns: dict[str, Any]) -> Check:
    ns.update(build_model=lambda: sharded(env.kind), reader=Reader(env.kind),
              loss_fn=lambda model, batch: loss_of(env.kind, model, batch))  # fmt: skip

    def check(ns: dict[str, Any]) -> None:  # a checkpoint every 10 steps, the last 3 kept
        steps = [c.step for c in list_checkpoints(env.path("/ckpt/lightning"))]
        assert steps[-3:] == [10, 20, 30] and ns["checkpointer"].restored_step is None, steps
        dist.destroy_process_group()

    return check


@standin("docs/entry-points.md", "delta-tracker")
def _entry_delta_tracker(env: Env, ns: dict[str, Any]) -> Check:
    reader = Reader(env.kind)
    ns.update(module=unsharded(env.kind), device=torch.device("cpu"), reader=reader,
              pg=dist.group.WORLD, topology=workload.planner_topology(dist.get_world_size(), "cpu"),
              train_step=step_fn(env.kind, ns, "dense_optimizer"))  # fmt: skip

    def check(ns: dict[str, Any]) -> None:  # a chain of deltas on TorchRec's own sharding
        checkpoints = list_checkpoints(env.path("/ckpt/delta-tracker"))
        assert [c.step for c in checkpoints] == [10, 20, 30]
        assert [len(c.chain) for c in checkpoints] == [1, 2, 3], checkpoints

    return check


@standin("docs/entry-points.md", "async-save")
def _entry_async_save(env: Env, ns: dict[str, Any]) -> Check:
    _live_job(env, ns, ("model", "dense_optimizer", "reader"))
    ns["train_step"] = step_fn(env.kind, ns, "dense_optimizer")
    want = model_digest(ns["model"])

    def check(ns: dict[str, Any]) -> None:  # the checkpoint holds the state of the call
        import torch.distributed.checkpoint as dcp

        assert model_digest(ns["model"]) != want, "training on changed nothing"
        state = {
            "model": ns["model"].state_dict(),
            "optim": ns["model"].fused_optimizer.state_dict(),
        }
        dcp.load(state, checkpoint_id=env.path("/ckpt/dcp/async"), process_group=ns["dcp_group"])
        ns["model"].load_state_dict(state["model"])
        ns["model"].fused_optimizer.load_state_dict(state["optim"])
        assert model_digest(ns["model"]) == want

    return check


def _fresh_job(env: Env, ns: dict[str, Any]) -> None:
    _live_job(env, ns, ("dmp", "dense_opt", "reader"))
    ns.update(train_step=step_fn(env.kind, ns, "dense_opt"), steps=TRAINED + EVERY)


@standin("docs/migration.md", "import")
def _migration_import(env: Env, ns: dict[str, Any]) -> Check:
    _fresh_job(env, ns)
    ns["root"] = env.path("/ckpt/imported")

    def check(ns: dict[str, Any]) -> None:
        ns["ckpt"].close()
        saved = list_checkpoints(ns["root"])
        assert [(c.step, c.kind) for c in saved] == [(TRAINED + EVERY, "full")], saved

    return check


@standin("docs/migration.md", "export")
def _migration_export(env: Env, ns: dict[str, Any]) -> None:
    ns["root"] = env.path("/ckpt/run1")


@standin("docs/migration.md", "export-ranks")
def _migration_export_ranks(env: Env, ns: dict[str, Any]) -> None:
    ns.update(root=env.path("/ckpt/run1"), out=env.path("/ckpt/dcp_out_ranks"))


def _same_as_step(env: Env, model: nn.Module) -> None:
    """Every local shard and dense tensor of ``model`` holds step 500 as the root does."""
    want = torchrec_cnr.export_state_dict(env.path("/ckpt/run1"), step=TRAINED)
    for key, value in model.state_dict().items():
        key = key.removeprefix("module.")
        if hasattr(value, "local_shards"):
            for shard in value.local_shards():
                at = shard.metadata.shard_offsets
                sizes = shard.metadata.shard_sizes
                block = want[key][at[0] : at[0] + sizes[0], at[1] : at[1] + sizes[1]]
                assert shard.tensor.equal(block), key
        else:
            assert value.equal(want[key]), key


@standin("docs/migration.md", "stock-load")
def _migration_stock_load(env: Env, ns: dict[str, Any]) -> Check:
    _live_job(env, ns, ("dmp", "dense_opt", "reader"))

    def check(ns: dict[str, Any]) -> None:
        _same_as_step(env, ns["dmp"])
        assert all(isinstance(k, int) for k in ns["dense_opt"].state_dict()["state"])

    return check


@standin("docs/migration.md", "torchsnapshot")
def _migration_torchsnapshot(env: Env, ns: dict[str, Any]) -> Check:
    _live_job(env, ns, ("dmp", "dense_opt", "reader"))
    ns["root"] = env.path("/ckpt/from_snapshot")

    def check(ns: dict[str, Any]) -> None:
        ns["ckpt"].close()
        _same_as_step(env, ns["dmp"])
        assert [c.step for c in list_checkpoints(ns["root"])] == [TRAINED]

    return check


@standin("docs/migration.md", "serving")
def _migration_serving(env: Env, ns: dict[str, Any]) -> Check:
    ns.update(root=env.path("/ckpt/run1"), unsharded_model=unsharded(env.kind, "cpu"))

    def check(ns: dict[str, Any]) -> None:
        ns["follower"].close()
        want = torchrec_cnr.export_state_dict(ns["root"], step=TRAINED)
        got = ns["unsharded_model"].state_dict()
        assert all(got[k].equal(v) for k, v in want.items())

    return check


@standin("docs/offline.md", "reading")
def _offline(env: Env, ns: dict[str, Any]) -> Check:
    _s3_copy(env, env.kind)
    ns["unsharded_model"] = unsharded(env.kind, "cpu")

    def check(ns: dict[str, Any]) -> None:
        assert ns["weights"].shape == (TABLES["t_user"], DIM)
        assert ns["some"].equal(ns["weights"][[3, 17, 40_000]])

    return check


def _target(env: Env) -> Any:
    return torchrec_cnr.FloatTarget(unsharded(env.kind, "cpu"))


@standin("docs/serving.md", "follow")
def _serving_follow(env: Env, ns: dict[str, Any]) -> Check:
    ns.update(root=env.path("/ckpt/run1"), target=_target(env))

    def check(ns: dict[str, Any]) -> None:
        assert ns["follower"].step == TRAINED

    return check


@standin("docs/serving.md", "options")
def _serving_options(env: Env, ns: dict[str, Any]) -> Check:
    ns.update(root=env.path("/ckpt/run1"), target=_target(env), spill_dir=env.tmp)

    def check(ns: dict[str, Any]) -> None:
        follower = ns["follower"]
        assert follower.options.memory_budget_bytes == 64 << 20
        assert follower.poll() == TRAINED
        follower.close()

    return check


@standin("docs/serving.md", "pin")
def _serving_pin(env: Env, ns: dict[str, Any]) -> Check:
    ns["follower"] = torchrec_cnr.Follower(env.path("/ckpt/run1"), _target(env))
    assert ns["follower"].poll() == TRAINED

    def check(ns: dict[str, Any]) -> None:
        assert ns["follower"].step == 300 and not ns["follower"].pinned
        assert ns["follower"].poll() == TRAINED
        ns["follower"].close()

    return check
