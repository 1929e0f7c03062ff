"""The serving process beside a training job: a DLRM that follows the job's checkpoint
root and answers requests while the job trains.

It builds the job's DLRM unsharded on CPU, quantizes its tables with TorchRec
(``quantize_embeddings``, ``serve.dtype``) unless it serves fp32, and keeps it at the
root's latest committed step with a :class:`torchrec_cnr.Follower` polling every
``serve.interval_s``: each update reads only the rows changed since the served step. A
request thread answers held-out batches of the job's data stream at
``serve.requests_per_s``, each forward under ``follower.serving()``, so it sees one
committed step; with ``serve.step_rows`` each request also checks that it does (see
:class:`cnr_train.config.ServeConfig`).

When the job writes its done marker (:data:`cnr_train.job.DONE_MARKER`), the process
stops the requests and the follower, polls once more, checks that it serves the last
committed step, and evaluates the served model on the batches the job's final
evaluation used, so the served AUC compares with the trained one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torchrec.inference.modules import quantize_embeddings

from cnr_train.config import JobConfig, ServeDtype
from cnr_train.job import DONE_MARKER, freeze_heap, job_tables, make_data, num_dense
from cnr_train.workload import BatchStream, TableSpec, dlrm
from torchrec_cnr import FloatTarget, Follower, QuantizedTarget, shutdown
from torchrec_cnr.offline import CheckpointInfo, list_checkpoints, root_info
from torchrec_cnr.serving import ServingTarget, UpdateReport
from torchrec_cnr.snapshot.buffers import advise_huge_pages
from torchrec_cnr.storage import Storage

__all__ = ["RequestLoop", "Server", "StepRows", "freshness", "serving_model", "serving_target"]

DTYPES: dict[ServeDtype, torch.dtype | None] = {
    "fp32": None,
    "int8": torch.qint8,
    "int4": torch.quint4x2,
    "int2": torch.quint2x4,
}
"""``serve.dtype`` -> the dtype ``quantize_embeddings`` takes (``None``: not quantized)."""


def serving_model(tables: list[TableSpec], num_dense: int, dtype: ServeDtype) -> nn.Module:
    """The job's DLRM, unsharded on CPU, its tables quantized for inference unless
    ``dtype`` is ``fp32``.

    The architecture must be :func:`cnr_train.workload.build_model`'s: the follower
    checks every table and dense tensor against the checkpoint and names any
    difference (``ModelMismatchError``). Every value comes from the checkpoint.

    Args:
        tables: the job's tables (see :func:`cnr_train.job.job_tables`).
        num_dense: dense features per sample.
        dtype: the served row type.
    """
    cpu = torch.device("cpu")
    # Tables built without drawing initial values (seconds at 1 GB), which the first
    # update overwrites: zeros until then, in huge pages (advised before the zeros touch
    # them: an update writes rows at random places of the tables).
    model = dlrm(tables, num_dense, torch.device("meta"), cpu)
    ebc = model.sparse_arch.embedding_bag_collection
    ebc.to_empty(device=cpu)
    with torch.no_grad():
        for weight in ebc.parameters():
            advise_huge_pages(weight)
            weight.zero_()
    model.eval()
    quantized = DTYPES[dtype]
    return model if quantized is None else quantize_embeddings(model, quantized, inplace=True)


def serving_target(model: nn.Module, dtype: ServeDtype) -> ServingTarget:
    """What the follower writes :func:`serving_model`'s rows through."""
    return FloatTarget(model) if DTYPES[dtype] is None else QuantizedTarget(model)


class StepRows:
    """The ``serve.step_rows`` probe: whether the served model's last row of every table
    holds the step the follower names (call under ``follower.serving()``)."""

    def __init__(self, target: ServingTarget) -> None:
        self.target = target
        self.last = {
            key: torch.tensor([t.num_embeddings - 1]) for key, t in target.tables().items()
        }
        self.checked = 0
        self.torn: list[dict[str, Any]] = []
        """Up to 20 requests that saw another step: the named step and each table's."""
        self.torn_count = 0
        self.first_seen: dict[int, float] = {}
        """Step -> when a request first read its rows (seconds since the epoch)."""

    def check(self, step: int | None) -> None:
        if step is None:
            return
        seen = {k: self.target.read_rows(k, rows)[0] for k, rows in self.last.items()}
        self.checked += 1
        self.first_seen.setdefault(step, time.time())
        # Steps are integers: a row within half of one holds the step (an int2 row of one
        # repeated value dequantizes to it up to fp16's bias).
        if any(float((row - step).abs().max()) >= 0.5 for row in seen.values()):
            self.torn_count += 1
            if len(self.torn) < 20:
                self.torn.append({"step": step, **{k: row.tolist() for k, row in seen.items()}})


class RequestLoop:
    """Answers one held-out batch after another on a thread, at a fixed rate.

    Request ``k`` is held-out batch ``k // world_size % batches`` of rank
    ``k % world_size``: the batches the job evaluates on, in turn.

    Args:
        model: the served model.
        follower: its follower; each forward holds ``follower.serving()``.
        data: the job's data stream.
        world_size: ranks of the job (held-out batches are per rank).
        batches: held-out batches per rank.
        per_s: requests per second.
        probe: the ``serve.step_rows`` check, run with each forward.
    """

    def __init__(
        self,
        model: nn.Module,
        follower: Follower,
        data: BatchStream,
        world_size: int,
        batches: int,
        per_s: float,
        probe: StepRows | None = None,
    ) -> None:
        self.model = model
        self.probe = probe
        self.follower = follower
        self.data = data
        self.world_size = world_size
        self.batches = batches
        self.period_s = 1.0 / per_s
        self.latencies_s: list[float] = []
        """Seconds per answered request, lock wait included."""
        self.steps: set[int] = set()
        """The steps requests were answered at."""
        self.error: Exception | None = None
        """Why the loop stopped early, if it did."""
        self.cpu_s = 0.0
        """CPU seconds the requests took (this thread's)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cnr-serve-requests", daemon=True)

    def start(self) -> None:
        """Starts answering; :meth:`close` stops (or, at the latest, interpreter exit)."""
        self._thread.start()
        shutdown.register(self)

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                k = 0
                while k == 0 or not self._stop.is_set():  # a started loop answers one at least
                    began = time.perf_counter()
                    rank, index = k % self.world_size, k // self.world_size % self.batches
                    batch = self.data.heldout(rank, index)
                    with self.follower.serving():
                        step = self.follower.step
                        self.model(batch.dense, batch.sparse)
                        if self.probe is not None:
                            self.probe.check(step)
                    self.latencies_s.append(time.perf_counter() - began)
                    if step is not None:
                        self.steps.add(step)
                    k += 1
                    self.cpu_s = time.thread_time()
                    self._stop.wait(max(0.0, self.period_s - (time.perf_counter() - began)))
        except Exception as e:  # surfaced by Server.run, never swallowed
            self.error = e

    def close(self) -> None:
        """Stops after the request in flight (or the first, if none was answered yet)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        shutdown.unregister(self)

    stop_thread = close


def _evaluate(
    model: nn.Module, data: BatchStream, world_size: int, batches: int
) -> dict[str, float]:
    """AUC and log loss on every rank's held-out batches: those of the job's final eval."""
    from torchmetrics.functional.classification import binary_auroc

    preds, labels = [], []
    with torch.inference_mode():
        for rank in range(world_size):
            for i in range(batches):
                b = data.heldout(rank, i)
                preds.append(torch.sigmoid(model(b.dense, b.sparse).squeeze(-1)))
                labels.append(b.labels)
    p, y = torch.cat(preds), torch.cat(labels)
    return {
        "auc": float(binary_auroc(p, y.long())),
        "logloss": float(nn.functional.binary_cross_entropy(p.clamp(1e-7, 1 - 1e-7), y)),
    }


def _full_reload_bytes(latest: CheckpointInfo) -> int:
    """Bytes of the checkpoint's tables and dense tensors in fp32: what reloading the whole
    served model reads at the least."""
    tables = sum(4 * s.num_embeddings * s.embedding_dim for s in latest.tables.values())
    dense = sum(4 * math.prod(shape) for shape in latest.dense.values())
    return tables + dense


def freshness(reports: list[UpdateReport], infos: list[CheckpointInfo]) -> list[dict[str, float]]:
    """How long trained rows waited to be served, per incremental update.

    An update serves the rows trained between the ``save()`` of the step served before it
    and its own step's save: the oldest waited ``served_at - saved_at(previous)`` (the
    worst), the newest ``served_at - saved_at(step)``, the middle one half-way (the median
    row, rows being trained evenly). Cold updates and checkpoints without ``saved_at`` are
    left out.

    Returns:
        ``{"step", "served_at", "mid_s", "worst_s"}`` per update.
    """
    by_step = {i.step: i for i in infos}
    out = []
    for before, r in zip(reports, reports[1:]):
        prev, info = by_step.get(before.step), by_step.get(r.step)
        if r.cold or prev is None or info is None:
            continue
        if prev.saved_at is None or info.saved_at is None:
            continue
        served_at = info.committed_at + r.lag_s
        worst, newest = served_at - prev.saved_at, served_at - info.saved_at
        out.append({"step": r.step, "served_at": served_at, "mid_s": (worst + newest) / 2,
                    "worst_s": worst})  # fmt: skip
    return out


def _done(storage: Storage, since: float) -> dict[str, Any] | None:
    """The job's done marker, if written after ``since`` (an older one is an earlier run's)."""
    got = storage.read(DONE_MARKER)
    if got is None:
        return None
    done: dict[str, Any] = json.loads(got[0])
    return done if done["finished_at"] >= since else None


class Server:
    """The serving process: model, follower and request loop; :meth:`close` releases them.

    Args:
        config: the training job's config (its tables, root, data and ``serve`` section).

    Example::

        server = Server(config)
        try:
            result = server.run()   # until the job has finished
        finally:
            server.close()
    """

    def __init__(self, config: JobConfig) -> None:
        self.config = config
        self.tables = job_tables(config)
        self.model = serving_model(self.tables, num_dense(config), config.serve.dtype)
        self.root = config.checkpoint.path
        io = dataclasses.replace(config.checkpoint.io, threads=config.serve.io_threads)
        self.storage = config.checkpoint.open_root(io)
        target = serving_target(self.model, config.serve.dtype)
        options = dataclasses.replace(config.serve.follower, io=io)
        self.follower = Follower(self.storage, target, options)
        self.probe = StepRows(target) if config.serve.step_rows else None
        self.requests: RequestLoop | None = None
        self._cpu0 = 0.0  # the process's CPU seconds when run() began
        # The process's CPU seconds, updates and the request thread's CPU seconds once the
        # first update after the cold start was served.
        self._warm: tuple[float, int, float] | None = None

    def run(self) -> dict[str, Any]:
        """Follows and serves until the job writes its done marker; then evaluates.

        Returns:
            The serving metrics (also written to ``serve.metrics_path`` if set).

        Raises:
            TimeoutError: the job did not finish within ``serve.timeout_s``.
            RuntimeError: the request loop failed, or the last poll did not reach the
                last committed step.
        """
        s = self.config.serve
        freeze_heap()
        started, self._cpu0 = time.time(), time.process_time()
        self.follower.start(s.interval_s)
        print(f"serving: following {self.root} every {s.interval_s} s", file=sys.stderr, flush=True)
        while (done := _done(self.storage, started)) is None:
            if time.time() - started > s.timeout_s:
                raise TimeoutError(
                    f"the job writing {self.root} did not finish within serve.timeout_s="
                    f"{s.timeout_s} s (no {DONE_MARKER} marker)"
                )
            if self.requests is None and self.follower.step is not None:
                self._start_requests()
            if self._warm is None and self.requests is not None and len(self.follower.reports) > 1:
                self._warm = time.process_time(), len(self.follower.reports), self.requests.cpu_s
            self._check_requests()
            time.sleep(s.interval_s)
        if self.requests is not None:
            self.requests.close()
        self.follower.stop()
        served = self.follower.poll()  # whatever the job committed since the last poll
        latest = root_info(self.storage).latest
        if latest is None or served != latest.step:
            raise RuntimeError(
                f"the follower serves step {served}, the last committed step is "
                f"{None if latest is None else latest.step}"
            )
        if self.requests is None:  # the job ended before anything was served: one request
            self._start_requests()
            assert self.requests is not None
            self.requests.close()
        self._check_requests()
        data, world = self.requests.data, self.requests.world_size
        result = self._result(latest, done, started)
        result.update(_evaluate(self.model, data, world, self.config.eval.batches))
        result["trained_auc"] = self._trained_auc()
        if s.metrics_path:
            path = Path(s.metrics_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result, indent=1))
        return result

    def _start_requests(self) -> None:
        """Starts answering requests, once a checkpoint is committed: it names the job's
        world size, which the held-out batches depend on."""
        latest = root_info(self.storage).latest
        if latest is None:
            return
        data = make_data(self.config, self.tables, latest.world_size)
        self.requests = RequestLoop(
            self.model,
            self.follower,
            data,
            latest.world_size,
            self.config.eval.batches,
            self.config.serve.requests_per_s,
            self.probe,
        )
        self.requests.start()

    def _check_requests(self) -> None:
        if self.requests is not None and self.requests.error is not None:
            raise RuntimeError("the request loop failed") from self.requests.error

    def _result(
        self, latest: CheckpointInfo, done: dict[str, Any], started: float
    ) -> dict[str, Any]:
        """The serving metrics; per-update rows and bytes count the incremental updates
        (a cold one reads every row)."""
        reports = self.follower.reports
        warm = [r for r in reports if not r.cold] or reports
        lags = [r.lag_s for r in reports]
        blocked = [r.blocked_s for r in reports]
        latencies = self.requests.latencies_s if self.requests else []
        infos = list_checkpoints(self.storage)
        fresh = freshness(reports, infos)
        return {
            "root": self.root,
            "dtype": self.config.serve.dtype,
            "interval_s": self.config.serve.interval_s,
            "served_step": self.follower.step,
            "job_step": done["step"],
            "seconds": time.time() - started,
            "following_at": started,
            "updates": len(reports),
            "cold_updates": sum(r.cold for r in reports),
            "lag_median_s": statistics.median(lags),
            "lag_max_s": max(lags),
            "bytes_per_update_median": statistics.median(r.bytes_read for r in warm),
            "bytes_per_update_max": max(r.bytes_read for r in warm),
            "bytes_total": sum(r.bytes_read for r in reports),
            "cold_bytes": sum(r.bytes_read for r in reports if r.cold),
            "full_reload_bytes": _full_reload_bytes(latest),
            "rows_per_update_median": statistics.median(r.rows for r in warm),
            "rows_per_update_max": max(r.rows for r in warm),
            "fresh_median_s": statistics.median(f["mid_s"] for f in fresh) if fresh else None,
            "fresh_max_s": max(f["worst_s"] for f in fresh) if fresh else None,
            "blocked_median_s": statistics.median(blocked),
            "blocked_max_s": max(blocked),
            "swap": self.follower.swap,
            "spare_bytes": self.follower.spare_bytes,
            "requests": len(latencies),
            "request_steps": len(self.requests.steps) if self.requests else 0,
            "request_latency_median_s": statistics.median(latencies) if latencies else None,
            "request_latency_max_s": max(latencies) if latencies else None,
            # What following cost the store and the host, idle polls included.
            "polls": self.follower.polls,
            "idle_polls": self.follower.idle_polls,
            "idle_requests": self.follower.idle_requests,
            "storage_requests": self.follower.storage.requests,
            "storage_bytes": self.follower.storage.bytes_read,
            "cpu_s": time.process_time() - self._cpu0,
            "request_cpu_s": self.requests.cpu_s if self.requests else 0.0,
            # After the first update that followed the cold start (the cold start, the catch-up
            # after it and swap mode's second copy of the tables left out).
            **(
                {}
                if self._warm is None or self.requests is None
                else {
                    "warm_cpu_s": time.process_time() - self._warm[0],
                    "warm_updates": len(reports) - self._warm[1],
                    "warm_request_cpu_s": self.requests.cpu_s - self._warm[2],
                }
            ),
            "eval_batches": self.config.eval.batches,
            **self._probed(infos),
            "update_reports": [asdict(r) for r in reports],
        }

    def _probed(self, infos: list[CheckpointInfo]) -> dict[str, Any]:
        """The probe's counts, and for each step a request read: from the save that wrote
        its rows (the step's rows are written just before it) to that first read."""
        if self.probe is None:
            return {}
        saved = {i.step: i.saved_at for i in infos if i.saved_at is not None}
        waits = [t - saved[s] for s, t in self.probe.first_seen.items() if s in saved]
        return {
            "checked_requests": self.probe.checked,
            "torn_requests": self.probe.torn_count,
            "torn_examples": self.probe.torn,
            "probe_fresh_median_s": statistics.median(waits) if waits else None,
            "probe_fresh_max_s": max(waits) if waits else None,
        }

    def _trained_auc(self) -> float | None:
        """The job's final AUC from ``train.metrics_path`` (written before the marker)."""
        path = self.config.train.metrics_path
        if not path or not Path(path).exists():
            return None
        auc = json.loads(Path(path).read_text()).get("auc")
        return None if auc is None else float(auc)

    def close(self) -> None:
        """Stops the request loop and the follower and releases their threads."""
        if self.requests is not None:
            self.requests.close()
        self.follower.close()
