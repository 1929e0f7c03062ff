"""Reading and writing DCP checkpoints a block at a time, running no code from one, and the
export's options."""

from __future__ import annotations

import mmap
import os
import pickle
import threading
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from torchrec_cnr.errors import CheckpointReadError, UnsafeObjectError
from torchrec_cnr.interop import dcp_io
from torchrec_cnr.interop.dcp_export import ExportOptions, export_dcp
from torchrec_cnr.interop.dcp_io import Block, DcpReader, _ReadAhead, mapped, write_blocks
from torchrec_cnr.storage import DIRECT_MIN_BYTES


class Reader:
    """An app_state object of a type the reader is not told about."""

    def __init__(self, position: int) -> None:
        self.position = position


def test_blocks_written_in_pieces_read_back_in_other_pieces(tmp_path: Path) -> None:
    table = torch.randn(10, 6)

    def piece(r0: int, c0: int, n: int) -> Block:
        def load() -> torch.Tensor:
            return table[r0 : r0 + n, c0 : c0 + 3]

        return Block(("model", "t.weight"), (r0, c0), (n, 3), (10, 6), load)

    # Two column shards, the first cut in two row pieces.
    blocks = [piece(0, 0, 4), piece(4, 0, 6), piece(0, 3, 10)]
    write_blocks(tmp_path / "d", [blocks], {"app": {"step": 7, "ids": torch.arange(3)}})
    reader = DcpReader(tmp_path / "d")
    assert reader.size("model.t.weight") == (10, 6)
    assert [o for o, _ in reader.chunks("model.t.weight")] == [(0, 0), (0, 3), (4, 0)]
    out = torch.zeros(5, 4)
    reader.read([("model.t.weight", (3, 1), out)])  # across all three chunks
    assert torch.equal(out, table[3:8, 1:5])
    app = reader.objects("app", [])
    assert app["step"] == 7 and torch.equal(app["ids"], torch.arange(3))
    dcp_to_torch_save(tmp_path / "d", tmp_path / "all.pt")  # nested as saved
    whole = torch.load(tmp_path / "all.pt", weights_only=False)
    assert torch.equal(whole["model"]["t.weight"], table) and whole["app"]["step"] == 7


def test_objects_and_metadata_run_no_code(tmp_path: Path) -> None:
    dcp.save({"app": {"reader": Reader(3)}}, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    with pytest.raises(UnsafeObjectError, match="Reader"):
        DcpReader(tmp_path / "d").objects("app", [])
    assert DcpReader(tmp_path / "d").objects("app", [Reader])["reader"].position == 3

    ran = tmp_path / "ran"

    class Payload:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return os.system, (f"touch {ran}",)

    (tmp_path / "d" / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(CheckpointReadError, match="not a readable DCP checkpoint"):
        DcpReader(tmp_path / "d")
    assert not ran.exists()
    with pytest.raises(CheckpointReadError):
        DcpReader(tmp_path / "nothing")


def test_export_options_take_the_budget_in_mb_and_name_a_bad_field() -> None:
    assert ExportOptions().budget_bytes == 256 << 20
    assert ExportOptions(budget_mb=1.5).budget_bytes == 3 << 19
    assert ExportOptions(budget_mb=1 / 1024).budget_bytes == 1024
    listed = ExportOptions(safe_globals=["a.B"])  # type: ignore[arg-type]
    assert listed.safe_globals == ("a.B",)  # a list is kept as a tuple
    bad: list[tuple[dict[str, object], str]] = [
        ({"budget_mb": 1 / 2048}, "budget_mb must be at least"),
        ({"budget_mb": float("inf")}, "budget_mb must be at least"),
        ({"budget_mb": "64"}, "budget_mb must be at least"),
        ({"overwrite": 1}, "overwrite must be a bool"),
        ({"safe_globals": (3,)}, "safe_globals entries must be"),
        ({"threads": 0}, "threads must be a positive int"),
        ({"progress": 3}, "progress must be a function"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            ExportOptions(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="options must be an ExportOptions"):
        export_dcp("/nowhere", "/nowhere/out", None, {"budget_mb": 64})  # type: ignore[arg-type]


def _rows(table: torch.Tensor, log: list[str], fail: int | None = None) -> list[Block]:
    """A block per 2 rows of ``table``, each load logged (``fail``: that one raises)."""

    def load(i: int) -> torch.Tensor:
        log.append(f"load {i}")
        if i == fail:
            raise OSError(f"block {i} unreadable")
        return table[2 * i : 2 * i + 2].clone()

    n = table.shape[0] // 2
    return [
        Block(("model", "t"), (2 * i, 0), (2, 4), (2 * n, 4), partial(load, i)) for i in range(n)
    ]


def test_each_block_is_read_while_the_one_before_it_is_written(tmp_path: Path) -> None:
    table, log = torch.randn(10, 4), list[str]()
    write_blocks(tmp_path / "d", [[b] for b in _rows(table, log)])
    assert sorted(log) == [f"load {i}" for i in range(5)], "each block read once"
    out = torch.empty(10, 4)
    DcpReader(tmp_path / "d").read([("model.t", (0, 0), out)])
    assert torch.equal(out, table)
    assert not [t for t in threading.enumerate() if t.name.startswith("cnr-read-ahead")]


def test_each_group_is_read_while_the_one_before_it_is_written(tmp_path: Path) -> None:
    # Groups of a table's rows and their per-row state: the whole next group is read on
    # the read-ahead thread once the writer reaches a group, not one block ahead (which
    # read the next rows only while this group's small state was written).
    table, state = torch.randn(6, 4), torch.randn(6)
    log: list[str] = []

    def load(name: str, t: torch.Tensor) -> torch.Tensor:
        log.append(name)
        return t.clone()

    groups = [
        [
            Block(
                ("model", "t"), (r0, 0), (2, 4), (6, 4), partial(load, f"t{r0}", table[r0 : r0 + 2])
            ),
            Block(("optim", "s"), (r0,), (2,), (6,), partial(load, f"s{r0}", state[r0 : r0 + 2])),
        ]
        for r0 in (0, 2, 4)
    ]
    ahead = _ReadAhead(groups)

    def settled() -> list[str]:
        """The loads begun so far, once ended (the read-ahead thread runs them in order)."""
        ahead.pool.submit(lambda: None).result()
        return list(log)

    try:
        assert settled() == ["t0", "s0"], "the first group is read from the start"
        for i, then in enumerate((["t2", "s2"], [], ["t4", "s4"], [], [], [])):
            before = settled()
            ahead.blocks[i].load()  # the writer asks for block i
            assert settled() == before + then, (i, log)
    finally:
        ahead.close()
    write_blocks(tmp_path / "d", groups)
    for key, value in (("model.t", table), ("optim.s", state)):
        out = torch.empty_like(value)
        DcpReader(tmp_path / "d").read([(key, (0,) * value.dim(), out)])
        assert torch.equal(out, value)


def test_mapped_blocks_are_written_as_they_are_their_memory_reused_then_kept_for_the_next(
    tmp_path: Path,
) -> None:
    n = DIRECT_MIN_BYTES // 16  # rows of a block of a MiB
    table = torch.randn(3 * n, 4)
    given: list[torch.Tensor] = []

    def load(i: int) -> torch.Tensor:
        t = mapped([n, 4], torch.float32)
        assert t.untyped_storage().nbytes() == t.nbytes and t.data_ptr() % 4096 == 0
        t.copy_(table[n * i : n * (i + 1)])
        given.append(t)
        return t

    blocks = [
        Block(("model", "t"), (n * i, 0), (n, 4), (3 * n, 4), partial(load, i), owned=True)
        for i in range(3)
    ]
    lazy = _lazy_free_kb()
    write_blocks(tmp_path / "d", [[b] for b in blocks])
    out = torch.empty_like(table)
    DcpReader(tmp_path / "d").read([("model.t", (0, 0), out)])
    assert torch.equal(out, table)
    # The memory written is the memory given, not a copy, and a later block is read into
    # the memory of one written by then (its pages in memory; which one depends on when
    # the read ahead runs). What is spare when the write ends is kept for the next write,
    # its pages lazily freed: the kernel takes them back only when it needs memory.
    assert len({t.data_ptr() for t in given}) < 3, "no written block's memory reused"
    kept = {at for at, memory in dcp_io._MAPPED.items() if memory in dcp_io._spare}
    assert kept and kept <= {t.data_ptr() for t in given}
    assert _lazy_free_kb() > lazy, "spare pages not lazily freed"
    again = [Block(b.path, b.offsets, b.sizes, b.size, partial(load, i), owned=True)
             for i, b in enumerate(blocks)]  # fmt: skip
    given.clear()
    write_blocks(tmp_path / "again", [[b] for b in again])
    assert given[0].data_ptr() in kept, "the next write did not read into a kept mapping"
    DcpReader(tmp_path / "again").read([("model.t", (0, 0), out)])
    assert torch.equal(out, table)
    dcp_io._return_spare()
    assert not dcp_io._spare


def _lazy_free_kb() -> int:
    """This process's pages freed lazily (``MADV_FREE``) and not yet taken back, in KiB."""
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("LazyFree:"):
            return int(line.split()[1])
    return 0


def test_a_block_takes_a_written_blocks_memory_only_where_it_fits_holding_its_own_bytes() -> None:
    mib = DIRECT_MIN_BYTES
    written = mapped([2 * mib], torch.uint8)
    written.fill_(1)
    dcp_io._free(written)  # written: spare, its pages in memory
    block = mapped([mib + 1], torch.uint8)  # up to twice its size fits
    assert block.data_ptr() == written.data_ptr() and block.all(), "the pages taken as they are"
    tail = -(-(mib + 1) // mmap.PAGESIZE) * mmap.PAGESIZE
    assert not written[tail:].any(), "the pages past the block were not returned"
    dcp_io._free(block)
    larger = mapped([3 * mib], torch.uint8)  # nothing spare fits: the spare pages go back
    assert larger.data_ptr() != written.data_ptr() and not written.any()
    dcp_io._free(larger)
    dcp_io._return_spare()


def test_mapped_memory_is_for_large_tensors_and_a_bounded_number_of_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert mapped([16, 4], torch.float32).untyped_storage().resizable(), "a small one: as usual"
    monkeypatch.setattr(dcp_io, "MAX_MAPPED", len(dcp_io._MAPPED) + 1)
    first = mapped([DIRECT_MIN_BYTES], torch.uint8)
    assert not first.untyped_storage().resizable(), "mapped"
    second = mapped([DIRECT_MIN_BYTES], torch.uint8)
    assert second.untyped_storage().resizable(), "past the bound: as usual"


def test_a_block_read_ahead_that_fails_fails_the_write_and_leaves_no_thread(
    tmp_path: Path,
) -> None:
    log: list[str] = []
    with pytest.raises(OSError, match="block 2 unreadable"):
        write_blocks(tmp_path / "d", [[b] for b in _rows(torch.randn(10, 4), log, fail=2)])
    assert "load 4" not in log, "nothing read past the block after the one that failed"
    assert not [t for t in threading.enumerate() if t.name.startswith("cnr-read-ahead")]
