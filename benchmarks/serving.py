"""Train to serve: the app's training job and its serving process, side by side at 1 GB.

Each run is the app (``configs/serving.yaml``): ``scripts/serve.py`` follows the root and
answers requests while ``torchrun scripts/train.py`` commits every ``--interval-steps``,
writing each step into the last row of every table, which every request checks (else:
torn). One run per policy, served model, follower mode and storage. Per update: bytes read
against those changed, time to served and blocked (against a memcpy), lag, freshness.
``--followers 1 4``: several serving processes, each one's cost against a lone one's.
``--join-after N``: the followers start once the job has committed N checkpoints.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from benchmarks import measure
from benchmarks.harness import Bench, Case, Outcome, cli
from benchmarks.measure import QUANTS
from benchmarks.results import Column, Goal, Table
from cnr_train.job import DONE_MARKER
from cnr_train.serve import freshness
from torchrec_cnr.config import BACKGROUND
from torchrec_cnr.offline import CheckpointInfo, list_checkpoints
from torchrec_cnr.quantization import quantize
from torchrec_cnr.serving import UpdateReport
from torchrec_cnr.storage import open_storage

CONFIG = "configs/serving.yaml"
POLICIES = ("consecutive", "intermittent")
PAIRS = {"fp32": ("fp32", "fp32"), "int4": ("4-bit", "int4")}
"""Served type -> (checkpoint format, a key of :data:`QUANTS`; ``serve.dtype``)."""
MODES = ("copy", "swap", "budget")
"""The follower's copy mode, its swap mode, and copy mode with ``--budget-mb``."""
ID_BYTES = 4  # ids are stored as int32 below 2**31 rows (torchrec_cnr.staging)
MB = 2**20


def _arguments(p: argparse.ArgumentParser) -> None:
    measure.model_arguments(p, rows=1_000_000, tables=4)
    p.add_argument("--steps", type=int, default=90, help="training steps per run")
    p.add_argument("--interval-steps", type=int, default=3, help="steps between checkpoints")
    p.add_argument("--batch-size", type=int, default=8192)
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--served", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    p.add_argument("--storage", nargs="+", default=["fs"], choices=["fs", "s3"])
    p.add_argument("--nproc", type=int, default=2, help="training ranks")
    p.add_argument("--background", default="thread", choices=BACKGROUND,
                   help="where the job's writer runs")  # fmt: skip
    p.add_argument("--modes", nargs="+", default=["copy", "swap"], choices=MODES, help="the "
                   "follower's copy mode, swap mode, and copy mode with a memory budget")  # fmt: skip
    p.add_argument("--budget-mb", type=float, default=16.0,
                   help="--modes budget: the follower's memory budget")  # fmt: skip
    p.add_argument("--followers", nargs="+", type=int, default=[1], help="serving processes "
                   "on one root; with more than one, every run's run at nice 10")  # fmt: skip
    p.add_argument("--requests-per-s", type=float,
                   help="each serving process's requests (default: configs/serving.yaml's)")  # fmt: skip
    p.add_argument("--join-after", type=int, default=0, help="start the serving processes "
                   "once the job has committed this many checkpoints (0: before it starts)")  # fmt: skip


def _row_bytes(fmt: str, dim: int) -> int:
    """Bytes of one stored row: fp32 values, or the quantizer's parts for one row."""
    cfg = QUANTS[fmt]
    if cfg.method == "none":
        return 4 * dim
    assert isinstance(cfg.bits, int), cfg.bits
    q = quantize(torch.zeros(1, dim), cfg.method, cfg.bits)
    return sum(t.numel() * t.element_size() for t in q.to_tensors().values())


def _overrides(b: Bench, root: str, policy: str, served: str, mode: str, out: Path) -> list[str]:
    """The job's config overrides; the serving metrics go to ``out/serve.json``."""
    a = b.args
    fmt, dtype = PAIRS[served]
    q = QUANTS[fmt]
    return [
        f"checkpoint.path={root}", f"checkpoint.policy={policy}",
        f"checkpoint.background={a.background}", f"checkpoint.interval_steps={a.interval_steps}",
        f"checkpoint.quantize.method={q.method}", f"checkpoint.quantize.bits={q.bits}",
        f"checkpoint.quantize.min_rows={q.min_rows}",
        f"model.num_tables={a.tables}", f"model.max_rows={a.rows}", f"model.dim={a.dim}",
        f"data.batch_size={a.batch_size}",
        f"train.steps={a.steps}", f"train.metrics_path={out / 'train.json'}",
        f"serve.dtype={dtype}", f"serve.follower.swap={mode == 'swap'}",
        *([f"serve.follower.memory_budget_mb={a.budget_mb}"] if mode == "budget" else []),
        f"serve.metrics_path={out / 'serve.json'}",
        *([] if a.requests_per_s is None else [f"serve.requests_per_s={a.requests_per_s}"]),
    ]  # fmt: skip


def _key(storage: str, policy: str, served: str, mode: str, followers: int = 1) -> str:
    return (f"{storage}_{policy}_{served}" + ("" if mode == "copy" else f"_{mode}")
            + ("" if followers == 1 else f"_x{followers}"))  # fmt: skip


def _one_run(b: Bench, storage: str, policy: str, served: str, mode: str,
             followers: int = 1) -> dict[str, Any]:  # fmt: skip
    """The job and its serving processes on a fresh root: the first follower's figures, and
    with more, each one's store and CPU cost too (:func:`_fanout`)."""
    key = _key(storage, policy, served, mode, followers)
    out = b.scratch / key
    out.mkdir()
    root = f"s3://{measure.s3_bucket()}/{key}" if storage == "s3" else str(out / "root")
    args = ["--config", CONFIG, *_overrides(b, root, policy, served, mode, out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    began = time.time()
    names = [f"serve{i or ''}" for i in range(followers)]  # each serving process's files
    servers: list[subprocess.Popen[bytes]] = []
    job: subprocess.Popen[bytes] | None = None
    launched: dict[str, float] = {}  # a serving process's name -> when it was started
    store = os.environ.get("AWS_ENDPOINT_URL") if storage == "s3" else None
    processes_cpu, store_cpu = measure.children_cpu_s(), measure.store_cpu_s(store)

    def serve() -> None:
        for name in names:
            launched[name] = time.time()
            with open(out / f"{name}.log", "w") as log:
                servers.append(subprocess.Popen(
                    [sys.executable, "scripts/serve.py", *args,
                     f"serve.metrics_path={out / name}.json"],
                    stdout=log, stderr=subprocess.STDOUT, env=env,
                    preexec_fn=(lambda: os.nice(10))
                    if max(b.args.followers) > 1 and not b.args.smoke
                    else None,  # a smoke run's tiny job could end before a niced one polls
                ))  # fmt: skip
        _wait_following(out, servers)

    try:
        if not b.args.join_after:
            serve()
        with open(out / "train.log", "w") as log:
            job = subprocess.Popen(
                [torchrun, "--standalone", f"--nproc_per_node={b.args.nproc}", "scripts/train.py",
                 *args], stdout=log, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip
        if b.args.join_after:
            deadline = time.time() + 900
            while len(list_checkpoints(root)) < b.args.join_after:
                if job.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"the job did not commit {b.args.join_after} checkpoints "
                                       "(see train.log)")  # fmt: skip
                time.sleep(0.2)
            serve()
            if open_storage(root).read(DONE_MARKER) is not None:  # see _wait_following
                raise RuntimeError(f"{key}: the job ended before its followers started: train "
                                   "longer (--steps) or join earlier (--join-after)")  # fmt: skip
        job.wait(timeout=1800)
        served_rc = [s.wait(timeout=900) for s in servers]
        processes_cpu = measure.children_cpu_s() - processes_cpu
        store_end = measure.store_cpu_s(store)
        store_cpu = None if store_end is None or store_cpu is None else store_end - store_cpu
    finally:
        for proc in [*servers, *([job] if job is not None else [])]:
            if proc.poll() is None:
                proc.kill()
    for name, rc in zip(["train", *names], [job.returncode, *served_rc]):
        if rc != 0:
            tail = (out / f"{name}.log").read_text()[-3000:]
            raise RuntimeError(f"{key}: {name} exited {rc}; the end of its log:\n{tail}")
    metrics = [json.loads((out / f"{name}.json").read_text()) for name in names]
    row = _row_bytes(PAIRS[served][0], b.args.dim) + ID_BYTES
    infos = list_checkpoints(root)
    table_rows = b.args.tables * b.args.rows
    summaries = [_summarise(m, infos, row, table_rows, launched[n]) for m, n in zip(metrics, names)]
    summary = summaries[0] | _fanout(summaries, metrics, infos)
    # CPU seconds per commit of the run's processes, of the serving processes from following
    # on, of a local S3 server, against what the host's cores give in an interval.
    commits, interval_s = max(1, len(infos)), summary["interval_s"]
    summary["host_cpu"] = {
        "processes_s": processes_cpu / commits,
        "followers_s": sum(m["cpu_s"] for m in metrics) / commits,
        "store_s": None if store_cpu is None else store_cpu / commits,
        "cores_s": None if interval_s is None else (os.cpu_count() or 1) * interval_s}  # fmt: skip
    # The disk's own time for the bytes of the cold start, read cold (the job is over).
    cold_bytes = int(summary["cold_mb"] * MB)
    summary["cold_disk_s"] = measure.disk_read_s(out, cold_bytes) if storage == "fs" else None
    s = summary
    b.log(f"{key}: torn {s['torn_requests']}/{s['checked_requests']}, update "
          f"{s['update_s']:.2f} s, lag {s['lag_s']:.2f} s (max {s['lag_s_max']:.2f}), fresh "
          f"{s['fresh_s']:.2f} s (max {s['fresh_s_max']:.2f}), blocked "
          f"{s['blocked_s'] * 1e3:.1f} ms, read/changed {s['read_over_changed']:.2f}, served "
          f"{s['served_commits']}/{s['commits']} ({time.time() - began:.0f} s)")  # fmt: skip
    return {"storage": storage, "policy": policy, "served": served, "mode": mode,
            "followers": followers, "joined_after": b.args.join_after, "row_bytes": row, **summary,
            **({"budget_mb": b.args.budget_mb} if mode == "budget" else {})}  # fmt: skip


def _wait_following(out: Path, servers: list[subprocess.Popen[bytes]]) -> None:
    """Until every serving process follows the root: one that started following after the
    job ended would take its done marker for an earlier job's and wait for another."""
    deadline = time.time() + 300
    for i, server in enumerate(servers):
        log = out / f"serve{i or ''}.log"
        while "serving: following" not in log.read_text():
            if server.poll() is not None or time.time() > deadline:
                tail = log.read_text()[-3000:]
                raise RuntimeError(f"{log.name} did not start following:\n{tail}")
            time.sleep(0.2)


def _fanout(summaries: list[dict[str, Any]], metrics: list[dict[str, Any]],
            infos: list[CheckpointInfo]) -> dict[str, Any]:  # fmt: skip
    """Each follower's cost to the store and the host after its cold start, and the worst."""
    each = []
    commits = len(infos)
    for s, m in zip(summaries, metrics):
        reports = [UpdateReport(**r) for r in m["update_reports"]]
        cold = [r for r in reports if r.cold]
        # Caught up: after the first incremental update (it reads what the cold start missed).
        first = next(i for i, r in enumerate(reports) if not r.cold)
        later = [i for i in infos if i.step > reports[first].step]
        caught_up = m["storage_requests"] - sum(r.requests for r in reports[: first + 1])
        each.append({
            "requests_per_commit": (m["storage_requests"] - sum(r.requests for r in cold))
            / commits,
            "mb_per_commit": (m["storage_bytes"] - sum(r.bytes_read for r in cold)) / commits / MB,
            "idle_polls": m["idle_polls"],
            "idle_poll_requests": m["idle_requests"] / m["idle_polls"] if m["idle_polls"] else None,
            "requests_per_update": s["requests"],
            "caught_up_requests_per_commit": caught_up / len(later) if later else None,
            "read_over_changed": s["read_over_changed"],
            "follow_cpu_s_per_commit": (m["cpu_s"] - m["request_cpu_s"]) / commits,
            "follow_cpu_ms_per_update": s["follow_cpu_ms"], "served_commits": s["served_commits"],
            "torn_requests": s["torn_requests"], "lag_s": s["lag_s"],
        })  # fmt: skip
    return {
        "each_follower": each,
        **{f"worst_{k}": max((e[k] for e in each if e[k] is not None), default=None)
           for k in ("requests_per_commit", "requests_per_update", "mb_per_commit",
                     "caught_up_requests_per_commit", "idle_poll_requests", "read_over_changed",
                     "follow_cpu_s_per_commit", "follow_cpu_ms_per_update", "torn_requests")},
    }  # fmt: skip


def _summarise(m: dict[str, Any], infos: list[CheckpointInfo], row: int, table_rows: int,
               launched: float) -> dict[str, Any]:  # fmt: skip
    """Per incremental update: changed rows and bytes, read over them, freshness, a memcpy of
    the changed bytes (medians and worst); the start to the first step served."""
    reports = [UpdateReport(**r) for r in m["update_reports"]]
    fresh = {f["step"]: f for f in freshness(reports, infos)}
    committed = {i.step: i.committed_at for i in infos}
    first_served = committed[reports[0].step] + reports[0].lag_s
    served = {r.step for r in reports}
    updates = []
    for prev, r in zip(reports, reports[1:]):
        if r.step not in fresh:
            continue
        rows = sum(i.rows_changed or 0 for i in infos if prev.step < i.step <= r.step)
        updates.append({**asdict(r), "changed_rows": rows, "changed_bytes": rows * row,
                        "read_over_changed": r.bytes_read / max(1, rows * row),
                        "fresh_mid_s": fresh[r.step]["mid_s"],
                        "fresh_worst_s": fresh[r.step]["worst_s"],
                        "memcpy_s": measure.memcpy_s(rows * row),
                        "held_over_changed": r.held_bytes / max(1, rows * row)})  # fmt: skip
    if not updates:
        raise RuntimeError("no incremental update was served: train longer (--steps)")

    def med(k: str) -> float:
        return statistics.median(u[k] for u in updates)

    def worst(k: str) -> float:
        return max(u[k] for u in updates)

    intervals = [b.committed_at - a.committed_at for a, b in zip(infos, infos[1:])]
    # Rows changed in several of the commits one update covers count once each commit: the
    # update rewrites at most every row of the tables.
    scatter_rows = min(int(med("changed_rows")), table_rows)
    scatter = measure.scatter_s(scatter_rows, row - ID_BYTES, table_rows)
    warm = m.get("warm_updates")  # after the first update past the cold start, idle polls in
    follow_ms = (m["warm_cpu_s"] - m["warm_request_cpu_s"]) / warm * 1e3 if warm else None
    return {
        "commits": len(infos), "served_commits": len(served),
        "last_served": m["served_step"] == infos[-1].step,
        "interval_s": statistics.median(intervals) if intervals else None,
        "served_requests": m["requests"], "checked_requests": m["checked_requests"],
        "torn_requests": m["torn_requests"], "torn_examples": m["torn_examples"],
        "cold_s": next((r.seconds for r in reports if r.cold), None),
        "cold_mb": next((r.bytes_read for r in reports if r.cold), 0) / MB,
        "start_s": first_served - m["following_at"], "process_start_s": first_served - launched,
        "missed_commits": sum(i.step > reports[0].step and i.step not in served for i in infos),
        "update_s": med("seconds"), "update_s_max": worst("seconds"),
        "lag_s": med("lag_s"), "lag_s_max": worst("lag_s"),
        "fresh_s": med("fresh_mid_s"), "fresh_s_max": worst("fresh_worst_s"),
        "probe_fresh_s": m["probe_fresh_median_s"], "probe_fresh_s_max": m["probe_fresh_max_s"],
        "blocked_s": med("blocked_s"), "blocked_s_max": worst("blocked_s"),
        "blocked_over_memcpy": med("blocked_s") / max(med("memcpy_s"), 1e-9),
        "memcpy_ms": med("memcpy_s") * 1e3,
        "follow_cpu_ms": follow_ms, "scatter_ms": scatter * 1e3,
        "follow_cpu_over_memcpy": None if follow_ms is None
                                  else follow_ms / (med("memcpy_s") * 1e3),
        "held_mb": med("held_bytes") / MB, "held_mb_max": worst("held_bytes") / MB,
        "spilled_mb": med("spilled_bytes") / MB, "held_over_changed": med("held_over_changed"),
        "spare_mb": m.get("spare_bytes", 0) / MB,
        "changed_mb": med("changed_bytes") / MB, "read_mb": med("bytes_read") / MB,
        "read_over_changed": med("read_over_changed"),
        "read_over_changed_max": worst("read_over_changed"),
        "requests": med("requests"), "request_s": m["request_latency_median_s"],
        "updates": updates,
    }  # fmt: skip


def targets(runs: dict[str, Any]) -> list[Goal]:
    """Every run's: consistency, freshness, bytes read, blocking, CPU, and a joiner's start."""
    out: list[Goal] = []
    for key, run in runs.items():
        r = f"runs.{key}"
        if run.get("mode") == "swap":
            out.append(Goal(f"{key}: blocked <= 5 ms (median)", f"{r}.blocked_s", "<=", 0.005))
        else:
            if run.get("mode") == "budget":
                out.append(Goal(f"{key}: held <= the memory budget (worst)", f"{r}.held_mb_max",
                                "<=", run["budget_mb"]))  # fmt: skip
            out.append(Goal(f"{key}: blocked <= memcpy of the changed bytes (median)",
                            f"{r}.blocked_over_memcpy", "<=", 1.0))  # fmt: skip
        out += [
            Goal(f"{key}: torn snapshots = 0", f"{r}.torn_requests", "<=", 0.0),
            Goal(f"{key}: freshness <= 6 s (median)", f"{r}.fresh_s", "<=", 6.0),
            Goal(f"{key}: freshness <= interval + commit + 2 s (worst): lag <= 2 s",
                 f"{r}.lag_s_max", "<=", 2.0),
            Goal(f"{key}: bytes read <= 1.2 x changed rows + ids (median)",
                 f"{r}.read_over_changed", "<=", 1.2),
            Goal(f"{key}: every commit after the first served is served",
                 f"{r}.missed_commits", "<=", 0.0),
        ]  # fmt: skip
        if run.get("follow_cpu_over_memcpy") is not None:
            out.append(Goal(f"{key}: a follower's CPU per update <= 2x a memcpy of its changed "
                            "bytes (median)", f"{r}.follow_cpu_over_memcpy", "<=", 2.0))  # fmt: skip
        if run.get("joined_after"):
            out.append(Goal(f"{key}: a follower joining the running job serves within 3 s of "
                            "its start", f"{r}.start_s", "<=", 3.0))  # fmt: skip
        if run.get("followers", 1) > 1:
            out += _fanout_targets(runs, key)
    return out


def _fanout_targets(runs: dict[str, Any], key: str) -> list[Goal]:
    """Several followers on one root: each costs the store about what a lone one does."""
    run, r = runs[key], f"runs.{key}"
    n = run["followers"]
    out = []
    if run["worst_idle_poll_requests"] is not None:  # else every poll found a commit
        name = f"{key}: a poll that finds nothing costs each of {n} followers <= 1 request"
        out.append(Goal(name, f"{r}.worst_idle_poll_requests", "<=", 1.0))
    out += [
        Goal(f"{key}: every follower reads <= 1.2 x changed rows + ids (median)",
             f"{r}.worst_read_over_changed", "<=", 1.2),
        Goal(f"{key}: torn snapshots = 0 at every follower", f"{r}.worst_torn_requests", "<=", 0.0),
    ]  # fmt: skip
    lone = _key(run["storage"], run["policy"], run["served"], run["mode"])
    for what in ("caught_up_requests_per_commit", "mb_per_commit"):
        w = f"worst_{what}"
        if lone in runs and run[w] is not None and runs[lone][w] is not None:
            out.append(Goal(
                f"{key}: {what.replace('_', ' ')} of each follower <= 1.2 x a lone follower's",
                f"{r}.{w}", "<=", f"runs.{lone}.{w}", 1.2,
            ))  # fmt: skip
    return out


def tables(m: dict[str, Any]) -> list[Table]:
    runs = list(m["runs"].values())
    which: dict[str, Column] = {
        "storage": "storage", "policy": "policy",
        "served": lambda r: f"{PAIRS[r['served']][0]} -> {r['served']}",
        "mode": lambda r: r.get("mode", "copy"),
    }  # fmt: skip
    several = [r for r in runs if r.get("followers", 1) > 1]
    lone = {_key(r["storage"], r["policy"], r["served"], r["mode"]) for r in several}
    # The runs of several followers, and a lone follower of the same job.
    fanout = [{**e, "run": key, "follower": i} for key, r in m["runs"].items()
              if r in several or key in lone for i, e in enumerate(r["each_follower"])]  # fmt: skip
    consistency = Table.of("Consistency and freshness", runs, {
        **which,
        "torn / checked requests": lambda r: f"{r['torn_requests']} / {r['checked_requests']}",
        "served / commits": lambda r: f"{r['served_commits']} / {r['commits']}",
        "missed after first": "missed_commits",
        "start s": "start_s", "(process)": "process_start_s",
        "start MB": "cold_mb", "disk s (same MB)": "cold_disk_s", "interval s": "interval_s",
        "fresh s (median)": "fresh_s", "fresh s (worst)": "fresh_s_max",
        "step row first read s": "probe_fresh_s", "(worst)": "probe_fresh_s_max",
        "lag s (median)": "lag_s", "lag s (worst)": "lag_s_max",
    }, "A torn request read rows of another step than follower.step named. Missed after "
        "first: commits after the first served step that were never served. Start: from the "
        "follower's start (the serving process's) to its first step served; its MB read, and the "
        "disk's time to read as many bytes cold, sequentially, after the job (file system). "
        "Interval: median seconds between commits. Fresh: from a row's training step to served "
        "(the middle row of an update; the worst, trained right after the previous served save). "
        "Step row first read: from the save of a step to the first request that read the rows the "
        "job wrote at it (median, worst). Lag: commit to served.",
    )  # fmt: skip
    update = Table.of("Per update (median; worst where marked)", runs, {
        **which, "update s": "update_s", "update s (worst)": "update_s_max",
        "changed MB": "changed_mb", "read MB": "read_mb",
        "read / changed": "read_over_changed", "read / changed (worst)": "read_over_changed_max",
        "storage requests": "requests", "blocked ms": lambda r: r["blocked_s"] * 1e3,
        "blocked ms (worst)": lambda r: r["blocked_s_max"] * 1e3,
        "memcpy ms": "memcpy_ms", "blocked / memcpy": "blocked_over_memcpy",
        "follow CPU ms": "follow_cpu_ms", "CPU / memcpy": "follow_cpu_over_memcpy",
        "scatter ms": "scatter_ms", "held MB": "held_mb", "(worst)": "held_mb_max",
        "spilled MB": "spilled_mb", "held / changed": "held_over_changed",
        "spare MB": lambda r: r.get("spare_mb", 0.0),
        "request ms": lambda r: None if r["request_s"] is None else r["request_s"] * 1e3,
    }, "Changed: the rows changed since the served step, as stored, with int32 ids. "
        "Blocked: the exclusive hold of an update; memcpy: a copy of its changed bytes between "
        "warm buffers. Follow CPU: the serving process's CPU time, less its request thread's, "
        "over the updates after the first that followed the cold start (idle polls included; the "
        "cold start, the catch-up after it and swap mode's second copy of the tables left out); "
        "scatter: a write of as many rows at random places of a table as large as the model's, "
        "from a warm buffer (the least an update in place costs). Held: memory the update's rows "
        "took at once (as read, and in serving form where not a view of them; with a budget, the "
        "largest piece, and spilled: the mapped files); spare: swap mode's second copy of the "
        "tables. Request: one held-out batch's forward, waits included.",
    )  # fmt: skip
    followers = Table.of("Followers on one root (each its own process, at nice 10)", fanout, {
        "run": "run", "follower": "follower",
        "requests / commit": "requests_per_commit", "(caught up)": "caught_up_requests_per_commit",
        "MB / commit": "mb_per_commit",
        "requests / update": "requests_per_update", "requests / idle poll": "idle_poll_requests",
        "read / changed": "read_over_changed", "follow CPU s / commit": "follow_cpu_s_per_commit",
        "(ms / update, warm)": "follow_cpu_ms_per_update",
        "lag s (median)": "lag_s", "served commits": "served_commits", "torn": "torn_requests",
    }, "Per follower, after its cold start: requests and bytes it cost the store per commit "
        "of the job, idle polls included (caught up: after its first incremental update, "
        "which reads what the cold start missed); requests of an update (median) and of a "
        "poll that found nothing new; CPU seconds of following (the process's, less its "
        "request thread's) per commit, its cold start included, and per update after the "
        "first that followed the cold start.",
    )  # fmt: skip
    host = Table.of("The host's CPU per commit", [
        {"run": key, **r["host_cpu"]} for key, r in m["runs"].items() if "host_cpu" in r
    ], {
        "run": "run", "cores x interval s": "cores_s", "processes s": "processes_s",
        "serving processes s": "followers_s", "S3 server s": "store_s",
    }, "CPU seconds per commit: what the host's cores give in the median interval; what the "
        "run's processes used (the training job's, writer processes included, and the serving "
        "processes', their starts included); of that, the serving processes' from following "
        "on (following and answering requests); and the local S3 server's, moto's, on the "
        "same cores (the job's writes and every follower's reads).",
    )  # fmt: skip
    return [consistency, update, *([followers] if fanout else []), host]


def run(b: Bench) -> Outcome:
    a = b.args
    runs: dict[str, Any] = {}
    for storage in a.storage:
        with measure.s3_server() if storage == "s3" else contextlib.nullcontext():
            for one in itertools.product(a.policies, a.served, a.modes, a.followers):
                runs[_key(storage, *one)] = _one_run(b, storage, *one)
    model = {"tables": a.tables, "rows": a.rows, "dim": a.dim,
             "fp32_gb": a.tables * a.rows * a.dim * 4 / 2**30}  # fmt: skip
    m = {"model": model, "interval_steps": a.interval_steps, "batch_size": a.batch_size,
         "training_ranks": a.nproc, "join_after": a.join_after, "runs": runs}  # fmt: skip
    return Outcome(m, tables(m), targets(runs))


CASE = Case("serving", "Train to serve: torn snapshots, freshness, update time, bytes and "
            "blocking", _arguments, "--tables 2 --rows 2000 --dim 16 --steps 45 --batch-size 256 "
            "--policies intermittent --served int4 --modes swap", run)  # fmt: skip

if __name__ == "__main__":
    cli(CASE, __doc__)
