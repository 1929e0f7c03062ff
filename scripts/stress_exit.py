"""Every process exits 0: jobs run many times while other processes load every core.

    python scripts/stress_exit.py --runs 50 --out out/stress_exit.json
    python scripts/stress_exit.py --runs 50 --jobs quickstart_fused follower cli

The jobs:

- ``overhead``: the overhead benchmark's smoke run under torchrun (``-m benchmarks.overhead
  --smoke``);
- ``save_restore``: the app (``scripts/train.py``) on the demo DLRM at 2,000 rows a table,
  each run restoring the root the run before it left and saving twice more;
- ``quickstart_fused`` and ``quickstart_unfused``: a library-only job under torchrun,
  written as a user writes one (:func:`quickstart`): TorchRec's ``TestSparseNN`` sharded
  by the planner, trained under ``with CheckpointManager(...)`` with fused kernels (the
  sharders' row-wise Adagrad) or unfused ones (``apply_optimizer_in_backward``); after the
  block rank 0 exports the model (``export_state_dict``) and reads a table
  (``read_table``), and every rank exits;
- ``follower``: the fused job with a follower process beside it (:func:`follow`), which
  serves the root until the job is done, then exits without closing the follower (the
  library stops its thread at exit);
- ``cli``: ``cnr export`` and ``cnr verify`` of a trained root.

A run counts as an abort when a process died of a signal or printed ``terminate
called``; every other non-zero exit counts as a failure. Not part of ``make test``: 50
runs of every job take hours on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TORCHRUN = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2"]
JOBS = ("overhead", "save_restore", "quickstart_fused", "quickstart_unfused", "follower", "cli")


def _load(stop: mp.synchronize.Event) -> None:
    while not stop.is_set():  # a busy core, at the jobs' priority
        sum(i * i for i in range(10_000))


# -- the library-only job, as a user writes it ------------------------------------------


def _tables() -> list[Any]:
    """The tables of the library-only job and of its follower."""
    from torchrec import EmbeddingBagConfig

    return [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=16, num_embeddings=4000, feature_names=[f"f{i}"]
        )  # fmt: skip
        for i in range(3)
    ]


def quickstart(root: str, kernels: str, steps: int) -> None:
    """One rank of a job that uses the library and TorchRec only."""
    import torch
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig
    from torchrec.distributed.test_utils.test_model import ModelInput, TestSparseNN
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    import torchrec_cnr
    from torchrec_cnr.launch import init_distributed

    init_distributed()
    try:
        torch.manual_seed(0)
        tables = _tables()
        module = TestSparseNN(tables=tables, num_float_features=8,
                              sparse_device=torch.device("meta"))  # fmt: skip
        if kernels == "unfused":
            apply_optimizer_in_backward(RowWiseAdagrad, module.sparse.ebc.parameters(),
                                        {"lr": 0.05})  # fmt: skip
            fused = None
        else:
            fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
        sharders = torchrec_cnr.tracking_sharders(fused)
        world = dist.get_world_size()
        plan = EmbeddingShardingPlanner(
            topology=TopologyFactory.create_topology(
                TrainerConfig(world_size=world), kernel_config=KernelConfig(compute_device="cpu")
            )
        ).collective_plan(module, sharders, dist.group.WORLD)
        model = DistributedModelParallel(module, plan=plan, sharders=sharders,
                                         device=torch.device("cpu"))  # fmt: skip
        opt = torch.optim.Adam(
            dict(in_backward_optimizer_filter(model.named_parameters())).values()
        )
        config = torchrec_cnr.CheckpointConfig(path=root, policy="intermittent", interval_steps=5)
        with torchrec_cnr.CheckpointManager(model, config, {"dense_opt": opt}) as ckpt:
            start = ckpt.restore() or 0
            for step in range(start + 1, start + steps + 1):
                _, local = ModelInput.generate(batch_size=16, world_size=1, num_float_features=8,
                                               tables=tables, weighted_tables=[],
                                               random_seed=step * 8 + dist.get_rank())  # fmt: skip
                opt.zero_grad()
                loss, _ = model(local[0])
                loss.backward()
                opt.step()
                ckpt.maybe_save(step)
        if dist.get_rank() == 0:
            from torchrec_cnr import cli

            state = torchrec_cnr.export_state_dict(root)
            table = torchrec_cnr.read_table(root, "t0")
            assert state["sparse.ebc.embedding_bags.t0.weight"].equal(table)
            assert cli.main(["export", root, "--out", f"{root}-model.pt"]) == 0
        if os.environ.get("STRESS_KEEP_GROUP") != "1":
            dist.barrier()
    finally:
        if os.environ.get("STRESS_KEEP_GROUP") != "1":
            dist.destroy_process_group()


def follow(root: str, done: str) -> None:
    """A serving process: follows ``root`` until the file ``done`` exists, then exits
    with its follower still open."""
    import torch
    from torchrec.distributed.test_utils.test_model import TestSparseNN

    import torchrec_cnr

    torch.manual_seed(0)
    tables = _tables()
    served = TestSparseNN(tables=tables, num_float_features=8)
    follower = torchrec_cnr.Follower(root, torchrec_cnr.FloatTarget(served))
    follower.start(interval_s=0.05)
    deadline = time.monotonic() + 300
    while not Path(done).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    print(f"served step {follower.step} after {follower.polls} polls", flush=True)


# -- the driver -------------------------------------------------------------------------


def _commands(job: str, run: int, scratch: Path) -> list[list[str]]:
    """The processes of one run of ``job``, started in order (a list inside: together)."""
    me = [str(REPO / "scripts" / "stress_exit.py")]
    root = str(scratch / "root")
    if job == "overhead":
        out = scratch / f"overhead_{run}.json"
        return [[*TORCHRUN, "-m", "benchmarks.overhead", "--smoke", "--out", str(out),
                 "--scratch", str(scratch / f"overhead_{run}")]]  # fmt: skip
    if job == "save_restore":
        return [[*TORCHRUN, "scripts/train.py", "--config", "configs/demo.yaml",
                 f"checkpoint.path={root}", "model.max_rows=2000", "failure.steps=[]",
                 f"train.steps={40 * (run + 1)}", "train.clean_start=false",
                 "train.metrics_path=null", "train.figure_path=null", "eval.batches=2"]]  # fmt: skip
    if job in ("quickstart_fused", "quickstart_unfused"):
        kernels = job.split("_")[1]
        return [[*TORCHRUN, *me, "worker", "--root", root, "--kernels", kernels]]
    if job == "cli":
        if run == 0:
            return [[*TORCHRUN, *me, "worker", "--root", root], *_cli(root, scratch)]
        return _cli(root, scratch)
    raise ValueError(job)


def _cli(root: str, scratch: Path) -> list[list[str]]:
    cnr = str(BIN / "cnr")
    return [[cnr, "export", root, "--out", str(scratch / "model.pt")], [cnr, "verify", root]]


def _follower_run(
    run: int, scratch: Path, env: dict[str, str]
) -> list[subprocess.CompletedProcess[str]]:
    """The fused job and a follower process beside it."""
    me = [sys.executable, str(REPO / "scripts" / "stress_exit.py")]
    root, done = str(scratch / "root"), scratch / f"done_{run}"
    served = subprocess.Popen([*me, "follow", "--root", root, "--done", str(done)], cwd=REPO,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)  # fmt: skip
    job = subprocess.run([*TORCHRUN, *me[1:], "worker", "--root", root], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    done.write_text("done")
    out, err = served.communicate(timeout=300)
    return [job, subprocess.CompletedProcess(served.args, served.returncode, out, err)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    worker = sub.add_parser("worker", help="one rank of the library-only job (under torchrun)")
    worker.add_argument("--root", required=True)
    worker.add_argument("--kernels", choices=("fused", "unfused"), default="fused")
    worker.add_argument("--steps", type=int, default=20)
    serve = sub.add_parser("follow", help="a follower process until --done exists")
    serve.add_argument("--root", required=True)
    serve.add_argument("--done", required=True)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--jobs", nargs="+", default=list(JOBS), choices=JOBS)
    parser.add_argument("--loaders", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.command == "worker":
        quickstart(args.root, args.kernels, args.steps)
        return 0
    if args.command == "follow":
        follow(args.root, args.done)
        return 0
    return _stress(args)


def _stress(args: argparse.Namespace) -> int:
    stop = mp.Event()
    loaders = [mp.Process(target=_load, args=(stop,), daemon=True) for _ in range(args.loaders)]
    for p in loaders:
        p.start()
    counts: dict[str, dict[str, int]] = {}
    failures: list[dict[str, object]] = []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for job in args.jobs:
                scratch = Path(tmp) / job
                scratch.mkdir()
                tally = counts.setdefault(
                    job, {"runs": 0, "processes": 0, "exit_0": 0, "aborts": 0, "failed": 0}
                )
                for run in range(args.runs):
                    began = time.perf_counter()
                    if job == "follower":
                        procs = _follower_run(run, scratch, env)
                    else:
                        procs = [
                            subprocess.run(
                                cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900
                            )  # fmt: skip
                            for cmd in _commands(job, run, scratch)
                        ]
                    tally["runs"] += 1
                    codes = []
                    for proc in procs:
                        text = proc.stdout + proc.stderr
                        aborted = proc.returncode < 0 or "terminate called" in text
                        tally["processes"] += 1
                        tally["exit_0"] += proc.returncode == 0
                        tally["aborts"] += aborted
                        tally["failed"] += proc.returncode != 0 and not aborted
                        codes.append(f"{proc.returncode}{' ABORT' if aborted else ''}")
                        if proc.returncode != 0 or aborted:
                            failures.append({"job": job, "run": run, "rc": proc.returncode,
                                             "args": proc.args, "tail": text[-3000:]})  # fmt: skip
                    print(f"{job} {run + 1}/{args.runs}: exits {', '.join(codes)} "
                          f"({time.perf_counter() - began:.0f} s)", flush=True)  # fmt: skip
    finally:
        stop.set()
        for p in loaders:
            p.join()
    result = {"command": " ".join(sys.argv), "loaders": args.loaders, "counts": counts,
              "failures": failures}  # fmt: skip
    print(json.dumps(counts, indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
