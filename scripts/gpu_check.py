"""The full-stack GPU check: the library over TorchRec's sharded modules and FBGEMM's CUDA
kernels, in one command on a lent GPU machine (see ``../shared/gpu/README.md``)::

    source .device/gpu/on_device.sh
    python3 scripts/gpu_check.py --out $OUT/gpu_check_record.json --result $OUT/gpu_check.json

It records the device and the versions it ran (:mod:`torchrec_cnr.versions`), runs the
suite's ``gpu``-marked tests (``pytest -m gpu``) in a process beside the cases, and trains
a DLRM with one table of every sharding type one process allows, saving every ``--every``
steps and training on at once (hot rows, large batches, so the batches after a ``save()``
update rows still being staged), once per case: every fused optimizer FBGEMM has on the
device, every policy, lazy and eager staging, thread and process writers, 2/3/4/8-bit
rows. Per case:

- every committed checkpoint restores into a fresh model as it was when saved: bit-exact in
  fp32 (rows, optimizer state, step counters, dense state, the dense optimizer), within
  half a quantization step of the row's range quantized (the optimizer state exact);
- a job resumed from the middle checkpoint ends bit-identical to the uninterrupted one
  (fp32 cases).

Last, a follower serves the latest checkpoint into an unsharded fp32 model on the device
(FloatTarget; FBGEMM's ``IntNBit`` inference kernels are not in the GPU bundle, so a
quantized target is not checked there), and stock ``dcp.async_save`` with the library's
``DcpStager``, training on at once, loads back with ``dcp.load`` bit for bit. ``--device
cpu`` runs the same on CPU with gloo (the optimizers FBGEMM has on CPU): how the script is
tried without a GPU. Exits 1 if any check fails; the JSON holds every case's outcome,
rewritten after each case (a run cut short still leaves what it checked); ``--result``
writes it as a benchmark result too (``--from`` converts a record written earlier).
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.results import Goal, Table  # noqa: E402
from benchmarks.results import write as write_result  # noqa: E402
from cnr_train.quiet import quiet_third_party  # noqa: E402

quiet_third_party()  # before TorchRec and FBGEMM are imported

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from fbgemm_gpu.split_embedding_configs import EmbOptimType  # noqa: E402

from cnr_train.workload import (  # noqa: E402
    TableSpec,
    ZipfBatches,
    build_model,
    dense_optimizer,
    dlrm,
    train_step,
)
from torchrec_cnr import CheckpointConfig, CheckpointManager, FloatTarget, Follower, QuantizeConfig  # noqa: E402
from torchrec_cnr.config import Background, PolicyName, Staging  # noqa: E402
from torchrec_cnr.interop import DcpStager  # noqa: E402
from torchrec_cnr.launch import init_distributed  # noqa: E402
from torchrec_cnr.offline import list_checkpoints  # noqa: E402
from torchrec_cnr.tracking import model_state  # noqa: E402
from torchrec_cnr.versions import installed  # noqa: E402

LAYOUTS = ("table_wise", "row_wise", "column_wise", "table_column_wise", "table_row_wise",
           "grid_shard", "data_parallel")  # fmt: skip

OPTIMIZERS = {
    "exact_rowwise_adagrad": (EmbOptimType.EXACT_ROWWISE_ADAGRAD, 0.05),
    "exact_sgd": (EmbOptimType.EXACT_SGD, 0.1),
    "exact_adagrad": (EmbOptimType.EXACT_ADAGRAD, 0.05),
    "adam": (EmbOptimType.ADAM, 0.01),
    "partial_rowwise_adam": (EmbOptimType.PARTIAL_ROWWISE_ADAM, 0.01),
    "lamb": (EmbOptimType.LAMB, 0.01),
}
FOLLOWER, DCP = "follower (fp32, FloatTarget)", "dcp.async_save + DcpStager"
ON_CPU = ("exact_rowwise_adagrad", "exact_sgd", "exact_adagrad")
"""The fused optimizers FBGEMM runs on CPU; the others need CUDA."""


@dataclass(frozen=True)
class Case:
    name: str
    optimizer: str = "exact_rowwise_adagrad"
    policy: PolicyName = "intermittent"
    staging: Staging = "lazy"
    background: Background = "thread"
    bits: int | None = None


def cases(device: str) -> list[Case]:
    """The base case, then one axis changed at a time."""
    out = [Case("base")]
    out += [Case(f"optimizer={o}", optimizer=o) for o in OPTIMIZERS
            if o != "exact_rowwise_adagrad" and (device == "cuda" or o in ON_CPU)]  # fmt: skip
    out += [Case(f"policy={p}", policy=p) for p in ("full", "one_shot", "consecutive")]
    out += [
        Case("staging=eager", staging="eager"),
        Case("background=process", background="process"),
    ]
    out += [Case("eager+process", staging="eager", background="process")]
    out += [Case(f"bits={b}", bits=b) for b in (2, 3, 4, 8)]
    return out


def tables(rows: int) -> list[TableSpec]:
    return [TableSpec(f"t_{layout}", rows + 97 * i, 32, layout) for i, layout in enumerate(LAYOUTS)]


class Run:
    """One case's job: its model, dense optimizer, batches and manager on ``root``
    (``fresh``: a job that restores, whose writer is a thread whatever the case's)."""

    def __init__(
        self, case: Case, a: argparse.Namespace, root: str, seed: int, fresh: bool = False
    ) -> None:
        cuda = a.device == "cuda"
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        )
        optimizer, lr = OPTIMIZERS[case.optimizer]
        self.tables = tables(a.rows)
        self.model = build_model(self.tables, seed=seed, device=self.device,
                                 fused_params={"optimizer": optimizer, "learning_rate": lr})  # fmt: skip
        self.opt = dense_optimizer(self.model)
        self.data = ZipfBatches(self.tables, batch_size=a.batch, alpha=1.3, seed=0)
        quantize = QuantizeConfig()
        if case.bits is not None:
            quantize = QuantizeConfig(method="asymmetric", bits=case.bits, min_rows=0)
        config = CheckpointConfig(path=root, policy=case.policy, staging=case.staging,
                                  background="thread" if fresh else case.background,
                                  quantize=quantize)  # fmt: skip
        app = {"dense_opt": self.opt, "reader": self.data}
        self.ckpt = CheckpointManager(self.model, config, app)

    def step(self, step: int) -> None:
        self.data.position = step
        train_step(self.model, self.opt, self.data.batch(0, step).to(self.device))

    def state(self) -> dict[str, Any]:
        """Everything a checkpoint holds, copied to the host."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        out: dict[str, Any] = {}
        for s in model_state.local_shards(self.model):
            where = f"{s.spec.table}@{s.spec.row_offset},{s.spec.col_offset}"
            out[f"{where}/weight"] = s.weight.detach().cpu().clone()
            out.update({f"{where}/{k}": v.detach().cpu().clone() for k, v in s.states.items()})
            out[f"{where}/scalars"] = dict(s.scalar_states())
        out.update({f"dense/{k}": v.detach().cpu().clone()
                    for k, v in model_state.dense_state(self.model).items()})  # fmt: skip
        for i, per in self.opt.state_dict()["state"].items():
            out.update(
                {f"dense_opt/{i}/{k}": torch.as_tensor(v).cpu().clone() for k, v in per.items()}
            )
        return out


def differences(got: dict[str, Any], want: dict[str, Any], bits: int | None) -> list[str]:
    """What differs: exactly, except rows stored quantized (within half a step of their range)."""
    if got.keys() != want.keys():
        return [f"keys differ: {sorted(got.keys() ^ want.keys())[:4]}"]
    bad = []
    for key, w in want.items():
        g = got[key]
        if not isinstance(w, torch.Tensor):
            ok = g == w
        elif bits is not None and key.endswith("/weight") and not key.startswith("dense/"):
            span = (w.amax(1) - w.amin(1)).clamp_min(1e-12)
            # Half a step of the range, plus the fp16 scale and bias it is stored with.
            bound = span * (0.5 / (2**bits - 1) + 2e-3) + w.abs().amax(1) * 1e-3
            ok = bool(((g - w).abs().amax(1) <= bound).all())
        else:
            ok = g.dtype == w.dtype and torch.equal(g, w)
        if not ok:
            bad.append(key)
    return bad


def check_case(case: Case, a: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    root = str(scratch / case.name.replace("=", "_").replace("+", "_"))
    began = time.perf_counter()
    job = Run(case, a, root, seed=1)
    refs: dict[int, dict[str, Any]] = {}
    for step in range(1, a.steps + 1):
        job.step(step)
        if step % a.every == 0:
            refs[step] = job.state()
            job.ckpt.save(step)  # the next batches run at once, on rows still being staged
    job.ckpt.wait()
    final = job.state()
    job.ckpt.close()
    committed = [c.step for c in list_checkpoints(root)]
    problems = [] if committed == sorted(refs) else [f"committed {committed}, saved {sorted(refs)}"]
    for step in committed:
        fresh = Run(case, a, root, seed=2, fresh=True)
        restored = fresh.ckpt.restore(step)
        bad = differences(fresh.state(), refs[step], case.bits)
        if restored != step or bad:
            problems.append(f"restore of step {step} (got {restored}): {bad[:4]}")
        if step == committed[len(committed) // 2] and case.bits is None:
            for later in range(step + 1, a.steps + 1):
                fresh.step(later)
            bad = differences(fresh.state(), final, None)
            if bad:
                problems.append(f"resumed from step {step}, the end differs: {bad[:4]}")
        fresh.ckpt.close()
    return {**asdict(case), "checkpoints": committed, "problems": problems,
            "seconds": round(time.perf_counter() - began, 2)}  # fmt: skip


def check_dcp_stager(a: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """Stock ``dcp.async_save`` with the library's stager, training on at once; a fresh model
    loaded with stock ``dcp.load`` holds the tables, their optimizer state and the dense
    parameters of the call, bit for bit (on its own gloo group, as DCP's async_save needs)."""
    root = str(scratch / "dcp")
    group = dist.new_group(backend="gloo")
    job = Run(Case("dcp"), a, str(scratch / "dcp_unused"), seed=1)
    for step in (1, 2, 3):
        job.step(step)
    # TorchRec's recipe holds neither the dense optimizer nor the kernels' scalar counters.
    want = {k: v for k, v in job.state().items()
            if not k.startswith("dense_opt/") and not k.endswith("/scalars")}  # fmt: skip
    stager = DcpStager(job.model)
    began = time.perf_counter()
    response: Any = dcp.async_save(
        {"model": job.model.state_dict(), "optim": job.model.fused_optimizer.state_dict()},
        checkpoint_id=root, async_stager=stager, process_group=group,
    )  # fmt: skip
    blocked_s = time.perf_counter() - began
    for step in (4, 5, 6):
        job.step(step)  # at once: these batches update rows while they are staged
    response.upload_completion.result()  # with a stager, async_save answers two futures
    stager.close()
    moved = differences({k: v for k, v in job.state().items() if k in want}, want, None)
    job.ckpt.close()
    fresh = Run(Case("dcp"), a, str(scratch / "dcp_unused_fresh"), seed=2, fresh=True)
    target = {"model": fresh.model.state_dict(), "optim": fresh.model.fused_optimizer.state_dict()}
    dcp.load(target, checkpoint_id=root, process_group=group)
    fresh.model.load_state_dict(target["model"])
    fresh.model.fused_optimizer.load_state_dict(target["optim"])
    bad = differences({k: v for k, v in fresh.state().items() if k in want}, want, None)
    fresh.ckpt.close()
    problems = [f"loaded state differs from the call: {bad[:4]}"] if bad else []
    if not moved:
        problems.append("training on changed nothing: the check would prove nothing")
    return {"name": DCP, "blocked_s": round(blocked_s, 4),
            "problems": problems}  # fmt: skip


def check_follower(a: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """A follower serves the latest checkpoint of a job into an unsharded fp32 model."""
    root = str(scratch / "follow")
    job = Run(Case("follower", policy="consecutive"), a, root, seed=1)
    for step in range(1, a.steps + 1):
        job.step(step)
        if step % a.every == 0:
            job.ckpt.save(step)
    job.ckpt.wait()
    want = job.state()
    job.ckpt.close()
    device = job.device
    served = dlrm(job.tables, 4, device, device)
    follower = Follower(root, FloatTarget(served))
    problems = []
    try:
        follower.poll()
        bags = served.sparse_arch.embedding_bag_collection.embedding_bags
        for key, value in want.items():
            table, _, name = key.rpartition("/")
            if name != "weight" or table.startswith("dense"):
                continue
            short, _, offsets = table.rpartition("@")
            row, col = (int(x) for x in offsets.split(","))
            got = bags[short.rsplit(".", 1)[-1]].weight.detach()
            got = got[row : row + value.shape[0], col : col + value.shape[1]].cpu()
            if not torch.equal(got, value):
                problems.append(f"{table}: served rows differ")
        if follower.step != a.steps - a.steps % a.every:
            problems.append(f"served step {follower.step}")
    finally:
        follower.close()
    return {"name": FOLLOWER, "device": str(device), "problems": problems}


def start_pytest() -> tuple[list[str], subprocess.Popen[bytes], Any]:
    """The suite's ``gpu``-marked tests, in a process of their own that runs beside the cases
    (both check, neither is timed), its output in a file: the files that mark any (the others
    need packages a GPU machine may lack, such as the store servers)."""
    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
                   if "pytest.mark.gpu" in p.read_text())  # fmt: skip
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-o", "addopts=", "-p",
           "no:cacheprovider", *files]  # fmt: skip
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    return cmd, proc, log


def finish_pytest(timeout_s: float, cmd: list[str], proc: subprocess.Popen[bytes],
                  log: Any) -> dict[str, Any]:  # fmt: skip
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.seek(0)
    lines = log.read().decode(errors="replace").strip().splitlines()
    log.close()
    failed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    summary = lines[-1] if lines else ""
    if proc.returncode < 0:
        summary = f"killed after --pytest-timeout-s {timeout_s:g}; last line: {summary}"
    return {"command": " ".join(cmd[1:]), "rc": proc.returncode, "summary": summary,
            "failed": failed, "tail": lines[-40:]}  # fmt: skip


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())


def as_result(record: dict[str, Any], command: str) -> dict[str, Any]:
    """A check's record in the benchmarks' result format (:mod:`benchmarks.results`), for
    ``docs/benchmarks.md``: a table of the cases and the suite's gpu tests, and two targets."""

    def outcome(c: dict[str, Any]) -> str:
        if c["problems"]:
            return str(c["problems"][0]).strip().splitlines()[-1][:200]
        return "exact" if c.get("bits") is None else "within half a step"

    cases = [{"name": c["name"], "checkpoints": c.get("checkpoints"),
              "seconds": c.get("seconds"), "outcome": outcome(c)} for c in record["cases"]]  # fmt: skip
    pytest = record.get("pytest") or {}
    failed_tests = None  # not run; a run cut short counts as one failure
    if pytest:
        failed_tests = max(len(pytest["failed"]), int(pytest["rc"] != 0))
    measurements = {**{k: record.get(k) for k in ("device", "gpu", "cuda", "python", "versions")},
                    "cases": cases, "failed_cases": sum(bool(c["problems"]) for c in record["cases"]),
                    "pytest": pytest, "failed_tests": failed_tests}  # fmt: skip
    tables = [
        Table.of(f"Every case on {record.get('gpu') or record['device']}", cases, {
            "case": "name", "checkpoints": lambda c: " ".join(map(str, c["checkpoints"] or [])),
            "s": "seconds", "outcome": "outcome"}),
        Table("The suite's gpu-marked tests", ["summary", "failed"],
              [[pytest.get("summary", "not run"), " ".join(pytest.get("failed", [])) or "none"]]),
    ]  # fmt: skip
    goals = [Goal("every case restores exactly (and resumes bit-identically)", "failed_cases",
                  "<=", 0.0),
             Goal("every gpu-marked test passes", "failed_tests", "<=", 0.0)]  # fmt: skip
    return {"case": "gpu_check", "kind": "benchmark", "title": "The full stack on a GPU",
            "date": record.get("date") or _now(),
            "command": record.get("command") or command, "note": "", "smoke": False,
            "environment": {k: measurements[k] for k in ("device", "gpu", "cuda", "python")},
            "config": {}, "wall_s": record.get("wall_s"), "measurements": measurements,
            "tables": tables, "targets": goals}  # fmt: skip


def write(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--out", type=Path, default=Path("out/gpu_check.json"))
    p.add_argument("--cases", nargs="*", help="names of the cases to run (all if not given)")
    p.add_argument("--rows", type=int, default=20_000, help="rows per table (about)")
    p.add_argument("--batch", type=int, default=2048, help="samples per batch")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--every", type=int, default=2, help="a save every this many steps")
    p.add_argument("--no-pytest", dest="pytest", action="store_false")
    p.add_argument(
        "--no-follower",
        dest="follower",
        action="store_false",
        help="skip the follower and the dcp.async_save checks",
    )
    p.add_argument("--result", type=Path, help="also write the record as a benchmark result")
    p.add_argument(
        "--from",
        dest="source",
        type=Path,
        help="write --result from this record instead of running the check",
    )
    p.add_argument("--pytest-timeout-s", type=float, default=900, help="after the cases end")
    a = p.parse_args()
    command = "python3 " + " ".join(sys.argv)
    if a.source is not None:
        if a.result is None:
            p.error("--from needs --result")
        write_result(a.result, as_result(json.loads(a.source.read_text()), command))
        return 0
    began = time.perf_counter()
    record: dict[str, Any] = {"device": a.device, "versions": installed(),
                              "python": platform.python_version(), "command": command,
                              "date": _now()}  # fmt: skip
    if a.device == "cuda":
        record |= {"gpu": torch.cuda.get_device_name(), "cuda": torch.version.cuda}
    pytest = start_pytest() if a.pytest else None
    init_distributed("nccl" if a.device == "cuda" else "gloo")
    chosen = [c for c in cases(a.device) if not a.cases or c.name in a.cases]
    results = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as scratch:
        checks: list[tuple[str, Callable[[], dict[str, Any]]]] = [
            (c.name, functools.partial(check_case, c, a, Path(scratch))) for c in chosen
        ]
        if a.follower:
            checks += [(FOLLOWER, functools.partial(check_follower, a, Path(scratch))),
                       (DCP, functools.partial(check_dcp_stager, a, Path(scratch)))]  # fmt: skip
        for name, check in checks:
            try:
                got = check()
            except Exception:  # noqa: BLE001 - a case that raises is a failed case, recorded
                got = {"name": name, "problems": [traceback.format_exc(limit=8)]}
            results.append(got)
            write(a.out, record | {"cases": results, "ok": None})
            print(f"gpu_check: {'ok  ' if not got['problems'] else 'FAIL'} {got['name']} "
                  f"{got.get('seconds', '')}", *got["problems"], sep="\n  ", flush=True)  # fmt: skip
    dist.destroy_process_group()
    record["pytest"] = finish_pytest(a.pytest_timeout_s, *pytest) if pytest else None
    record["cases"] = results
    failed = [r["name"] for r in results if r["problems"]]
    pytest_failed = record["pytest"] is not None and record["pytest"]["rc"] != 0
    record["ok"] = not failed and not pytest_failed
    record["wall_s"] = round(time.perf_counter() - began, 1)
    write(a.out, record)
    if a.result is not None:
        write_result(a.result, as_result(record, command))
    print(f"gpu_check: {len(results) - len(failed)}/{len(results)} cases ok; pytest "
          f"{record['pytest']['summary'] if record['pytest'] else 'not run'}; wrote {a.out}")  # fmt: skip
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
