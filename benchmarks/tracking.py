"""Iteration time and memory of row tracking: none, torchrec_cnr's bitmaps (plain, with MFU
counters, with SSU sampling), TorchRec's ModelDeltaTracker (ID_ONLY) alone, and read by the
manager into its bitmaps once per ``--iters`` iterations.

One model carries both trackers; each round switches each variant on in turn, rotating,
for ``--iters`` iterations on the same kernels and batches; a variant's figure is its
median over ``--rounds``, after a warm-up round. Targets: our bitmap's overhead <= 1% and
<= ModelDeltaTracker's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torchrec.distributed.model_tracker.types import DeltaTrackerConfig, TrackingMode

from benchmarks.harness import Bench, Case, Outcome, cli
from benchmarks.measure import gathered, model_arguments, uniform_model
from benchmarks.results import Goal, Table
from cnr_train.workload import ZipfBatches, train_step
from torchrec_cnr.tracking import model_state
from torchrec_cnr.tracking.priority import KernelPriority
from torchrec_cnr.tracking.tracker import DeltaFeed

VARIANTS = {
    # key: (label, ours on, ModelDeltaTracker on, what our hooks record besides the bits)
    "none": ("none", False, False, "bitmap"),
    "bitmap": ("torchrec_cnr (bitmap)", True, False, "bitmap"),
    "mfu": ("torchrec_cnr + MFU counters", True, False, "mfu"),
    "ssu": ("torchrec_cnr + SSU 10%", True, False, "ssu"),
    "mdt": ("ModelDeltaTracker", False, True, "bitmap"),
    "fed": ("ModelDeltaTracker read by torchrec_cnr", True, True, "fed"),
}

TARGETS = [
    Goal("our bitmap tracking overhead <= 1%", "variants.bitmap.overhead_pct", "<=", 1.0),
    Goal("our bitmap tracking overhead <= ModelDeltaTracker's",
           "variants.bitmap.overhead_pct", "<=", "variants.mdt.overhead_pct"),
]  # fmt: skip


def _arguments(p: argparse.ArgumentParser) -> None:
    model_arguments(p, rows=500_000)
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--pooling", type=int, default=4)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--iters", type=int, default=10, help="iterations per variant per round")


def _mdt_bytes(tracker: Any) -> int:
    """Bytes ModelDeltaTracker holds: the ids (and states) of every lookup not yet read."""
    lookups = [lookup for each in tracker.store.per_fqn_lookups.values() for lookup in each]
    held = [t for lookup in lookups for t in (lookup.ids, getattr(lookup, "states", None))
            if isinstance(t, torch.Tensor)]  # fmt: skip
    return sum(t.numel() * t.element_size() for t in held)


class _MdtSwitch:
    """Turns ModelDeltaTracker's post-lookup hooks off and on."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.modules = [(m, m.post_lookup_tracker_fn, m.post_odist_tracker_fn)
                        for m in model.modules()
                        if getattr(m, "post_lookup_tracker_fn", None) is not None]  # fmt: skip
        assert self.modules, "ModelDeltaTracker registered no hook"

    def set_enabled(self, enabled: bool) -> None:
        for module, lookup_fn, odist_fn in self.modules:
            setattr(module, "post_lookup_tracker_fn", lookup_fn if enabled else None)  # noqa: B010
            setattr(module, "post_odist_tracker_fn", odist_fn if enabled else None)  # noqa: B010


def run(b: Bench) -> Outcome:
    a = b.args
    model, opt, tables = uniform_model(a, tracking_mode="mfu")
    data = ZipfBatches(tables, a.batch_size, pooling=a.pooling, seed=0)
    config = DeltaTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, delete_on_read=True,
                                consumers=[DeltaFeed.CONSUMER])  # fmt: skip
    mdt = model.init_torchrec_delta_tracker(config)
    ours = list(model_state.trackers(model).values())
    theirs = _MdtSwitch(model)
    # The manager's reading of ModelDeltaTracker, into our bitmaps.
    feed = DeltaFeed(mdt)
    for s in model_state.local_shards(model):
        assert s.words is not None and s.recent is not None
        feed.add(s.spec.state_dict_key.removesuffix(".weight"), s.words, s.recent)
    # One model for every mode: our hooks switch what they record besides the bits.
    hooks = [hook for t in ours for _, hook in t._hooks]
    priorities: dict[str, list[KernelPriority | None]] = {
        "bitmap": [None for _ in hooks], "fed": [None for _ in hooks],
        "mfu": [h.priority for h in hooks],
        "ssu": [KernelPriority("ssu", h.words.numel(), h.words.device, 0.1) for h in hooks],
    }  # fmt: skip
    step = 0
    iters = dict.fromkeys(VARIANTS, 0)
    unread: dict[str, int] = {}

    def variant(key: str) -> float:
        nonlocal step
        _, ours_on, theirs_on, mode = VARIANTS[key]
        for h, p in zip(hooks, priorities[mode]):
            h.priority, h.fed = p, mode == "fed"
        for t in ours:
            t.set_enabled(ours_on)
        theirs.set_enabled(theirs_on)
        feed.drain()  # what the last variant left in ModelDeltaTracker, outside the timing
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(a.iters):
            step += 1
            train_step(model, opt, data.batch(b.rank, step))
        if theirs_on:  # what ModelDeltaTracker holds after --iters iterations, unread
            unread[key] = max(unread.get(key, 0), _mdt_bytes(mdt))
        if mode == "fed":
            feed.drain()
        dist.barrier()
        iters[key] += a.iters
        return (time.perf_counter() - t0) / a.iters

    b.interleaved(1, VARIANTS, variant, settle=False, label="warm-up")
    times = b.interleaved(a.rounds, VARIANTS, variant, settle=False, label="iteration s")
    bits = sum(t.memory_bytes() for t in ours)
    memory = {"none": 0, "bitmap": bits, "mdt": unread["mdt"], "fed": bits + unread["fed"]} | {
        mode: bits + sum(p.nbytes for p in priorities[mode] if p is not None)
        for mode in ("mfu", "ssu")
    }  # fmt: skip
    med = {k: statistics.median(v) for k, v in times.items()}
    variants = {
        k: {"iter_ms": 1e3 * med[k], "overhead_pct": 100 * (med[k] / med["none"] - 1),
            "memory_bytes": memory[k], "iterations_tracked": iters[k]}
        for k in VARIANTS
    }  # fmt: skip
    per_rank = gathered(variants)
    shards = model_state.local_shards(model)
    shard_bytes = sum(s.weight.numel() * s.weight.element_size() for s in shards)
    m = {"rank0_shard_bytes": shard_bytes, "variants": per_rank[0], "per_rank": per_rank}

    def held(v: dict[str, Any]) -> str:
        share = 100 * v["memory_bytes"] / shard_bytes
        return f"{v['memory_bytes'] / 1e6:.3f} MB ({share:.3f}% of the shard bytes)"

    title = f"Rank 0 (its shards hold {shard_bytes / 1e6:.0f} MB); median of {a.rounds} rounds"
    rows = [{"key": k, **v} for k, v in per_rank[0].items()]
    table = Table.of(title + f" x {a.iters} iterations per variant", rows, {
        "variant": lambda v: VARIANTS[v["key"]][0], "iter ms": "iter_ms",
        "overhead %": "overhead_pct", "tracker memory on rank 0": held,
        "iterations tracked": "iterations_tracked",
    }, "Ours is fixed in size; ModelDeltaTracker's grows with the iterations until read "
       f"(here: read every {a.iters} iterations, the most it held).")  # fmt: skip
    return Outcome(m, [table], TARGETS)


CASE = Case("tracking", "Tracking overhead (one model, one run)", _arguments,
            "--tables 2 --rows 2000 --dim 16 --batch-size 64 --rounds 2 --iters 2", run)  # fmt: skip

if __name__ == "__main__":
    cli(CASE, __doc__)
