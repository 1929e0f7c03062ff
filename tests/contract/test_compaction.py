"""Compaction, for every policy: a chain compacted into one full checkpoint restores exactly
what the chain did, bit for bit (nothing re-quantized, each table in its stored encoding),
whether compacted by the job (``compact()``, ``compact_every`` in the background) or
offline by ``cnr compact``; saves go on while a compaction writes, and one that fails, is
left behind by a restore or is killed midway leaves the chain the restore target."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cnr_train.workload import TableSpec
from tests import reference
from tests.faults import Fault, FaultyStorage
from tests.jobs import interval_config, make_job, restores_exactly, save_reference
from tests.multiprocess import run_ranks
from torchrec_cnr import (
    CheckpointConfig,
    CheckpointError,
    CheckpointManager,
    QuantizeConfig,
    Timeouts,
    read_table,
)
from torchrec_cnr.cli import main as cnr
from torchrec_cnr.commit import CommitTarget
from torchrec_cnr.compaction import compact_entry
from torchrec_cnr.iocontext import IOContext, IOOptions
from torchrec_cnr.manifest import Entry, Manifest
from torchrec_cnr.offline import checkpoint_info
from torchrec_cnr.selection import POLICIES
from torchrec_cnr.selection.policy import Policy
from torchrec_cnr.storage import CountingStorage, open_storage
from torchrec_cnr.testing.rows import modify
from torchrec_cnr.tracking import model_state

STEPS, EVERY = 12, 3
QUANT: dict = {"method": "adaptive", "bits": 4, "min_rows": 1000}


def _compact_in_job(root: str, refs: str, policy: str, quant: dict | None) -> None:
    job = make_job("ebc", optimizer="exact_adagrad", seed=1)
    with CheckpointManager(
        job.model, interval_config(root, policy, EVERY, quant), job.app_state
    ) as ckpt:
        job.run(1, STEPS, refs, ckpt=ckpt)
        ckpt.wait()
        if policy != "full":
            torch.save(
                {t: read_table(root, t) for t in reference.latest_tables(root)},
                Path(refs) / f"chain-{ckpt.rank}.pt",
            )
        assert ckpt.compact() == (policy != "full")
        ckpt.wait()
        # Training and checkpointing go on from the compacted checkpoint.
        job.step(STEPS + 1)
        ckpt.save(STEPS + 1)
        save_reference(job, refs, STEPS + 1)


def _restores_exactly(
    root: str, refs: str, step: int, quantized: bool, optimizer: str = "exact_adagrad"
) -> None:
    job = make_job("ebc", optimizer=optimizer, seed=5)
    with CheckpointManager(job.model, CheckpointConfig(path=root), job.app_state) as ckpt:
        assert ckpt.restore(step=step) == step
    if not quantized:
        reference.assert_model_matches(
            job.model, job.app_state, reference.load_all(Path(refs), step)
        )


@pytest.mark.dist
@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "4-bit"])
@pytest.mark.parametrize("policy", POLICIES)
def test_a_compacted_chain_restores_exactly_what_the_chain_did(
    policy: str, quantized: bool, root: str, refs: Path
) -> None:
    run_ranks(2, _compact_in_job, root, str(refs), policy, QUANT if quantized else None)
    manifest = Manifest.load(root)
    at_12 = manifest.find(STEPS)
    assert at_12 is not None
    if policy == "full":
        assert at_12.compacted_from is None
        return
    assert at_12.kind == "full" and at_12.chain == [at_12.id] and at_12.compacted_from
    assert at_12.id.endswith("-c")
    # The compacted checkpoint reads as the chain did, bit for bit: nothing re-quantized.
    chain = torch.load(refs / "chain-0.pt")
    for table, values in chain.items():
        assert torch.equal(read_table(root, table, STEPS), values), table
    assert cnr(["verify", root]) == 0
    run_ranks(2, _restores_exactly, root, str(refs), STEPS, quantized)
    # The next checkpoint builds on the compacted one.
    after = manifest.find(STEPS + 1)
    assert after is not None and manifest.chain(after)[0] == at_12.id
    run_ranks(2, _restores_exactly, root, str(refs), STEPS + 1, quantized)


def _whole_shard_deltas(root: str, refs: str) -> None:
    job = make_job("ebc", optimizer="exact_sgd", seed=1)
    with CheckpointManager(job.model, CheckpointConfig(path=root, policy="consecutive")) as ckpt:
        job.step(1)
        ckpt.save(1)
        ckpt.wait()
        # Every row of every other shard changes: those deltas hold whole shards (no ids).
        shards = model_state.local_shards(job.model)
        modify(
            shards, [torch.arange(0, s.spec.rows, 1 if i % 2 else 7) for i, s in enumerate(shards)]
        )
        ckpt.save(2)
        ckpt.wait()
        reference.save(reference.take(job.model, {}), Path(refs), 2)
        assert ckpt.compact()


@pytest.mark.dist
def test_deltas_that_hold_whole_shards_compact_exactly(root: str, refs: Path) -> None:
    run_ranks(2, _whole_shard_deltas, root, str(refs))
    manifest = Manifest.load(root)
    delta = manifest.checkpoints[1]
    assert delta.kind == "delta" and any(r.all_rows for r in manifest.shards(delta))
    assert any(not r.all_rows and r.saved_rows for r in manifest.shards(delta))
    latest = manifest.latest()
    assert latest is not None and latest.compacted_from == delta.id
    for table, values in reference.tables_at(refs, 2).items():
        assert torch.equal(read_table(root, table), values["weight"]), table


def _note_last(refs: str, step: int) -> None:
    """Tells the test the last step saved (a loop's, which ran until something happened)."""
    if dist.get_rank() == 0:
        (Path(refs) / "last").write_text(str(step))


def _last(refs: Path) -> int:
    return int((refs / "last").read_text())


def _compacted_base(root: str) -> str | None:
    """The compaction the latest checkpoint's chain starts from, if it is a delta on one."""
    manifest = Manifest.load(root)
    latest = manifest.latest()
    assert latest is not None
    first = manifest.chain(latest)[0]
    return first if latest.depth > 1 and first.endswith("-c") else None


def _compact_every(root: str, refs: str, background: str) -> None:
    job = make_job("ebc", optimizer="exact_sgd", seed=1)
    cfg = CheckpointConfig(
        path=root,
        policy="consecutive",
        interval_steps=1,
        compact_every=3,
        keep_last=1,
        background=background,  # type: ignore[arg-type]
    )
    with CheckpointManager(job.model, cfg, job.app_state) as ckpt:
        step, bases = 0, set[str | None]()
        while len(bases) < 2:  # compactions landed beside a later checkpoint, which builds on it
            assert step < 300, "no compaction ever landed"
            step += 1
            job.step(step)
            ckpt.save(step)
            ckpt.wait()
            bases.add(_compacted_base(root))
            bases.discard(None)
        save_reference(job, refs, step)
        _note_last(refs, step)


@pytest.mark.dist
@pytest.mark.parametrize("background", ["thread", "process"])
def test_compact_every_bounds_the_chain_and_keep_last_retires_the_links(
    any_root: str, refs: Path, background: str
) -> None:
    # The compaction runs beside the commits; the checkpoint that lands it, and every later
    # one, build on it, and keep_last=1 then leaves only the latest chain on storage.
    run_ranks(2, _compact_every, any_root, str(refs), background)
    manifest = Manifest.load(any_root)
    latest = manifest.latest()
    assert latest is not None and manifest.chain(latest)[0].endswith("-c") and latest.depth <= 3
    assert set(open_storage(any_root).children()) == manifest.needed_ids(1)
    step = _last(refs)
    run_ranks(2, _restores_exactly, any_root, str(refs), step, False, "exact_sgd")


QUANT_3BIT = QuantizeConfig(method="asymmetric", bits=3)
"""Its large tables stored 3-bit, its small ones (under ``min_rows``) fp32."""


def _compacts_a_quantized_chain(root: str, count: int) -> None:
    job = make_job("ebc", optimizer="exact_adagrad", seed=1)
    cfg = CheckpointConfig(
        path=root, policy="consecutive", interval_steps=1, compact_every=2, quantize=QUANT_3BIT
    )
    read: dict[int, dict[str, torch.Tensor]] = {}  # what each step read before compaction
    with CheckpointManager(job.model, cfg, job.app_state) as ckpt:
        step = 0
        while sum(e.compacted_from is not None for e in Manifest.load(root).checkpoints) < count:
            assert step < 400, "the compactions never landed"
            step += 1
            job.step(step)
            ckpt.save(step)
            ckpt.wait()
            if dist.get_rank() == 0:
                first = Manifest.load(root)
                tables = first.record(first.checkpoints[0]).tables
                read[step] = {t: read_table(root, t, step) for t in tables}
    # Two more deltas on the chain, which starts at a compaction now, for the CLI to compact.
    once = dataclasses.replace(cfg, compact_every=None)
    with CheckpointManager(job.model, once, job.app_state) as ckpt:
        assert ckpt.restore() == step
        last = step + 2
        for more in (step + 1, last):
            job.step(more)
            ckpt.save(more)
            ckpt.wait()
        if dist.get_rank() == 0:
            read[last] = {t: read_table(root, t, last) for t in tables}
            torch.save(read, Path(root).parent / "read.pt")


@pytest.mark.dist
def test_background_compactions_keep_each_tables_stored_encoding(root: str) -> None:
    count = 5
    run_ranks(2, _compacts_a_quantized_chain, root, count)
    manifest = Manifest.load(root)
    full = manifest.checkpoints[0]
    assert full.kind == "full" and not full.compacted_from
    full_shards = manifest.shards(full)
    stored = {
        (r.spec.table, r.spec.rank, r.spec.row_offset, r.spec.col_offset): r for r in full_shards
    }
    assert {r.format.method for r in full_shards} == {"asymmetric", "none"}
    compactions = [e for e in manifest.checkpoints if e.compacted_from]
    assert len(compactions) >= count
    read = torch.load(Path(root).parent / "read.pt")
    for c in compactions:
        assert len(manifest.shards(c)) == len(full_shards)
        for r in manifest.shards(c):
            was = stored[(r.spec.table, r.spec.rank, r.spec.row_offset, r.spec.col_offset)]
            assert (r.format, r.parts) == (was.format, was.parts), (c.id, r.spec.table)
            # The same rows in the same encoding; only the ids of the rows the compacted
            # checkpoint changed come on top (int64 each).
            assert 0 <= r.nbytes - was.nbytes <= 8 * r.recent_rows, (c.id, r.spec.table)
        # Nothing re-quantized: each table reads as the chain it compacts did.
        for table, values in read[c.step].items():
            assert torch.equal(read_table(root, table, c.step), values), (c.id, table)
        print(f"{c.id}: {c.bytes} bytes (the first full checkpoint: {full.bytes})")
    # Offline, the CLI's compaction of deltas on a compaction keeps them too.
    latest = manifest.latest()
    assert latest is not None and latest.depth > 2
    assert manifest.chain(latest)[0] in {c.id for c in compactions}
    assert cnr(["compact", root]) == 0
    after = Manifest.load(root)
    offline = after.latest()
    assert offline is not None and offline.compacted_from == latest.id
    assert {(r.spec.table, r.format) for r in after.shards(offline)} == {
        (r.spec.table, r.format) for r in full_shards
    }
    for table, values in read[latest.step].items():
        assert torch.equal(read_table(root, table, latest.step), values), table


def _saves_go_on_while_a_compaction_writes(root: str, refs: str) -> None:
    # The compaction of step 3 is held before its files are durable: checkpoints 4-6
    # commit meanwhile; released, it lands with the next one, right after step 3's entry.
    held = Fault("make_durable", "-c", "hold", times=1)
    job = make_job("ebc", optimizer="exact_sgd", seed=1)
    cfg = CheckpointConfig(path=root, policy="consecutive", interval_steps=1, compact_every=2)
    storage = FaultyStorage(root, held)
    with CheckpointManager(job.model, cfg, job.app_state, storage=storage) as ckpt:
        for step in range(1, 7):
            job.step(step)
            ckpt.save(step)
            ckpt.wait()
            save_reference(job, refs, step)
        manifest = Manifest.load(root)
        assert manifest.steps() == [1, 2, 3, 4, 5, 6], "a save waited for the compaction"
        held.released.set()
        step = 6
        while _compacted_base(root) is None:
            assert step < 300, "the compaction never landed"
            step += 1
            job.step(step)
            ckpt.save(step)
            ckpt.wait()
            save_reference(job, refs, step)
        manifest = Manifest.load(root)
        latest = manifest.latest()
        assert latest is not None and manifest.chain(latest)[0].endswith("-c")
        assert manifest.chain(latest)[1:] == [e.id for e in manifest.checkpoints if 3 < e.step]
        _note_last(refs, step)


@pytest.mark.dist
def test_saves_go_on_while_a_compaction_writes_and_it_lands_after_its_checkpoint(
    root: str, refs: Path
) -> None:
    run_ranks(2, _saves_go_on_while_a_compaction_writes, root, str(refs))
    manifest = Manifest.load(root)
    steps = manifest.steps()
    compacted = [e for e in manifest.checkpoints if e.compacted_from and e.step == 3]
    assert len(compacted) == 1
    assert steps[: steps.index(3) + 2] == [1, 2, 3, 3], "placed right after what it compacts"
    found = manifest.find(3)
    assert found is not None and found.id == compacted[0].id, "a restore of step 3 reads it"
    last = _last(refs)
    for step in (3, 5, last):  # the compaction, a delta on the old chain, one on it
        run_ranks(2, _restores_exactly, root, str(refs), step, False, "exact_sgd")
    assert cnr(["verify", root]) == 0


def _restore_leaves_the_compaction(root: str) -> None:
    held = Fault("make_durable", "-c", "hold", times=1)
    job = make_job("ebc", optimizer="exact_sgd", seed=1)
    cfg = CheckpointConfig(path=root, policy="consecutive", interval_steps=1, compact_every=2)
    with CheckpointManager(
        job.model, cfg, job.app_state, storage=FaultyStorage(root, held)
    ) as ckpt:
        for step in range(1, 5):
            job.step(step)
            ckpt.save(step)
            ckpt.wait()
        assert ckpt.restore(2) == 2  # the job leaves the chain the compaction of step 3 ends
        held.released.set()
        for step in range(3, 9):
            job.step(step)
            ckpt.save(step)
            ckpt.wait()


@pytest.mark.dist
def test_a_compaction_of_a_chain_the_job_left_is_dropped_with_its_files(root: str) -> None:
    run_ranks(2, _restore_leaves_the_compaction, root)
    manifest = Manifest.load(root)
    named = {e.id for e in manifest.checkpoints}
    # Checkpoint 2 (step 3) was compacted, but the job restored step 2 and went on: sequence
    # numbers 4 on.
    left = [e for e in manifest.checkpoints if (e.compacted_from or "").startswith("000002-")]
    assert not left, "the compaction of a chain the job left is not committed"
    assert set(open_storage(root).children()) <= named, "no compaction files left behind"
    assert cnr(["verify", root]) == 0


def _compaction_fails_on_one_rank(root: str, refs: str) -> None:
    fails = [Fault("make_durable", "-c", times=1)] if dist.get_rank() == 1 else []
    job = make_job("ebc", optimizer="exact_sgd", seed=1)
    cfg = CheckpointConfig(path=root, policy="consecutive", interval_steps=1, compact_every=2)
    reported = []
    with CheckpointManager(
        job.model, cfg, job.app_state, storage=FaultyStorage(root, *fails)
    ) as ckpt:
        step = 0
        while step < 2 or _compacted_base(root) is None:  # until the second one lands
            assert step < 300, "no compaction landed after the failed one"
            step += 1
            job.step(step)
            ckpt.save(step)
            try:
                ckpt.wait()
            except CheckpointError as e:
                reported.append(str(e))
            save_reference(job, refs, step)
        assert len(reported) == 1, reported
        assert re.search(r"compaction after the checkpoint of step \d+ failed: on rank 1: .*"
                         r"injected", reported[0]), reported[0]  # fmt: skip
        _note_last(refs, step)


@pytest.mark.dist
def test_a_failed_compaction_is_reported_and_the_checkpoints_beside_it_commit(
    root: str, refs: Path
) -> None:
    run_ranks(2, _compaction_fails_on_one_rank, root, str(refs))
    manifest = Manifest.load(root)
    named = {e.id for e in manifest.checkpoints}
    assert set(open_storage(root).children()) <= named, "the failed compaction's files went"
    steps = [e.step for e in manifest.checkpoints if not e.compacted_from]
    last = _last(refs)
    assert steps == list(range(1, last + 1)), "every checkpoint committed"
    run_ranks(2, _restores_exactly, root, str(refs), last, False, "exact_sgd")


def _killed_mid_compaction(root: str, refs: str) -> None:
    job = make_job("ebc", optimizer="exact_sgd", seed=1)
    cfg = CheckpointConfig(
        path=root,
        policy="consecutive",
        interval_steps=EVERY,
        timeouts=Timeouts(collective_timeout_s=30),
    )
    kill = Fault("make_durable", "-c", "sigkill") if dist.get_rank() == 1 else None
    storage = FaultyStorage(root, *filter(None, [kill]))
    ckpt = CheckpointManager(job.model, cfg, job.app_state, storage=storage)
    for step in range(1, 7):
        job.step(step)
        if ckpt.maybe_save(step):
            save_reference(job, refs, step)
    ckpt.wait()
    ckpt.compact()
    ckpt.wait()  # rank 1 is SIGKILLed inside the compaction


@pytest.mark.dist
def test_a_compaction_killed_midway_leaves_the_chain_the_restore_target(
    root: str, refs: Path
) -> None:
    import torch.multiprocessing as mp

    with pytest.raises(mp.ProcessExitedException, match="SIGKILL"):
        run_ranks(2, _killed_mid_compaction, root, str(refs))
    latest = Manifest.load(root).latest()
    assert latest is not None
    assert latest.compacted_from is None and latest.depth == 2
    assert cnr(["verify", root]) == 0
    run_ranks(2, _restores_exactly, root, str(refs), 6, False, "exact_sgd")
    # Offline, the CLI compacts it (the job is gone and its lease with it).
    assert cnr(["compact", root, "--take-over"]) == 0
    manifest = Manifest.load(root)
    latest = manifest.latest()
    assert latest is not None and latest.compacted_from and latest.chain == [latest.id]
    # The killed attempt's directory went with the next commit.
    assert set(open_storage(root).children()) == {e.id for e in manifest.checkpoints}
    run_ranks(2, _restores_exactly, root, str(refs), 6, False, "exact_sgd")


WIDE = [TableSpec("a", 3000, 16, "table_wise"), TableSpec("b", 4001, 16, "row_wise")]


def _chain(root: str, refs: str, quant: dict | None) -> None:
    quantize = QuantizeConfig(**(quant or {}))
    job = make_job(WIDE, root, seed=1, data_seed=2, policy="consecutive", quantize=quantize)
    for step in range(1, 6):
        job.train(1)
        job.ckpt.save(step)
        job.ckpt.wait()
    save_reference(job, refs, 5)
    job.ckpt.close()


def _compact_counting(
    root: str, io_options: IOOptions | None = None
) -> tuple[Entry, dict[str, torch.Tensor], int, int]:
    """The latest chain of ``root`` compacted here through a counting storage: the
    compacted entry, each table as the chain read before, the bytes the compaction read
    and the chain's stored bytes."""
    chain = {t: read_table(root, t) for t in reference.latest_tables(root)}
    stored = checkpoint_info(root).restore_bytes
    counting = CountingStorage(open_storage(root))
    generation = Manifest.load(root).writer_generation
    target = CommitTarget(counting, Policy("consecutive"), generation, None)  # type: ignore[arg-type]
    io = IOContext(io_options)
    try:
        compacted = compact_entry(target, io)
    finally:
        io.close()
    assert compacted is not None and compacted.chain == [compacted.id]
    return compacted, chain, counting.bytes_read, stored


@pytest.mark.dist
@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "4-bit"])
def test_a_chain_compacted_a_window_of_rows_at_a_time_reads_each_block_once_and_restores_exactly(
    quantized: bool, root: str, refs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Objects (and checked blocks) of 4 KB: a compaction window (WINDOW_OBJECTS objects)
    # holds about 16 KB of a shard's rows over its five links, so each shard of 200-250 KB
    # (rows and optimizer state) is merged in dozens of windows, each delta's rows read in
    # the blocks they lie in; a block that two windows share is read once.
    monkeypatch.setenv("TORCHREC_CNR_OBJECT_MB", "0.004")
    run_ranks(2, _chain, root, str(refs), QUANT if quantized else None)
    compacted, chain, read, stored = _compact_counting(root)
    assert compacted.compacted_from
    # Every stored byte of the chain once, and its metadata (records, indexes, manifest):
    # reading a shared block again would be 2-3x here.
    assert stored <= read <= 1.1 * stored, (read, stored)
    for table, values in chain.items():
        assert torch.equal(read_table(root, table, 5), values), table
    assert cnr(["verify", root]) == 0
    if not quantized:
        run_ranks(2, restores_exactly, WIDE, root, str(refs), 5, seed=9, data_seed=2)


RESHARDED = [TableSpec("a", 3000, 16, "table_wise"), TableSpec("b", 2001, 16, "column_wise")]


def _resharded_chain(root: str, refs: str, quant: dict | None) -> None:
    # A consecutive chain saved table- and column-wise, continued by a job sharded row-wise
    # (and quantized, for ``quant``): the same policy, so its deltas extend the chain.
    job = make_job(RESHARDED, root, seed=1, data_seed=2, policy="consecutive")
    for step in (1, 2):
        job.train(1)
        job.ckpt.save(step)
    job.ckpt.close()
    quantize = QuantizeConfig(**(quant or {}))
    other = [dataclasses.replace(t, sharding="row_wise") for t in RESHARDED]
    job = make_job(other, root, seed=7, data_seed=2, policy="consecutive", quantize=quantize)
    assert job.ckpt.restore() == 2
    for step in (3, 4):
        job.train(1)
        job.ckpt.save(step)
        job.ckpt.wait()
    save_reference(job, refs, 4)
    job.ckpt.close()


@pytest.mark.dist
@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "4-bit"])
def test_a_resharded_chain_is_decoded_a_window_at_a_time_and_reads_as_the_chain_did(
    quantized: bool, root: str, refs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its links store the tables in two layouts (and formats): the rows are decoded to the
    # values a restore gives and stored as fp32, here in windows of 16 KiB (the bound of
    # every read) over shards of 100-200 KB, each link's rows in 4 KiB checked blocks.
    monkeypatch.setenv("TORCHREC_CNR_OBJECT_MB", "0.004")
    run_ranks(2, _resharded_chain, root, str(refs), QUANT | {"min_rows": 0} if quantized else None)
    manifest = Manifest.load(root)
    latest = manifest.latest()
    assert latest is not None and len(manifest.chain(latest)) == 4
    compacted, chain, read, stored = _compact_counting(root, IOOptions(read_memory_mb=16 / 1024))
    records = Manifest.load(root).shards(compacted)
    assert {r.format.method for r in records} == {"none"}, "decoded: stored as fp32"
    # Each stored byte of the chain about once: a window reads only the blocks it needs.
    assert stored <= read <= 1.2 * stored, (read, stored)
    for table, values in chain.items():
        assert torch.equal(read_table(root, table, 4), values), table
    assert cnr(["verify", root]) == 0
    if not quantized:
        other = [dataclasses.replace(t, sharding="row_wise") for t in RESHARDED]
        run_ranks(2, restores_exactly, other, root, str(refs), 4, seed=9, data_seed=2)
