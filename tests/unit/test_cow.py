"""Lazy staging's compiled copier (``staging/_cow.c``): rows claimed by atomic bits, so
the background copy and the lookup hook, on two threads at once, copy every staged row
exactly once and never after training changed it."""

from __future__ import annotations

import ctypes
import random
import threading

import pytest
import torch

from torchrec_cnr.iocontext import IOOptions
from torchrec_cnr.staging import StagingPool, cow
from torchrec_cnr.tracking import bitmap


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    # The project's setup (pip install -e .) builds it: a missing library fails here.
    found = cow.library()
    assert found is not None, "the compiled copier is not built: run make setup"
    return found


class _Table:
    """A live shard (weight and a per-row state, or a strided view) and its staging."""

    def __init__(
        self, rows: int, dim: int, seed: int, strided: bool, fraction: float, tail: bool = False
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        wide = torch.randn(rows, dim + (3 if strided else 0), generator=g)
        self.weight = wide[:, :dim] if strided else wide
        self.state = torch.rand(rows, generator=g)
        held = torch.rand(rows, generator=g) < fraction
        self.rows = held.nonzero().flatten() if fraction < 1 else None
        n = rows if self.rows is None else self.rows.numel()
        self.selected = self.tail = None
        if self.rows is not None:
            words = bitmap.from_mask(held)
            counts = bitmap.popcounts(words)
            self.selected = (words, torch.cumsum(counts, 0) - counts)
        if tail and self.rows is not None:
            # A cumulative delta: the held rows changed since the last checkpoint go last.
            last = held & (torch.rand(rows, generator=g) < 0.4)
            bits = bitmap.from_mask(last)
            counts = bitmap.popcounts(bits)
            self.rows = torch.cat([(held & ~last).nonzero().flatten(), last.nonzero().flatten()])
            self.tail = (bits, torch.cumsum(counts, 0) - counts, n - int(last.sum()))
        self.staged_weight = torch.zeros(n, dim)
        self.staged_state = torch.zeros(n)
        self.claims = torch.zeros(cow.claim_words(n), dtype=torch.int64)
        # What the checkpoint must hold: the rows as they are now.
        pick = slice(None) if self.rows is None else self.rows
        self.want = (self.weight[pick].clone(), self.state[pick].clone())

    @property
    def n(self) -> int:
        return self.staged_weight.shape[0]

    def args(self, base: int) -> cow.Rows:
        pairs = [(self.weight, self.staged_weight), (self.state, self.staged_state)]
        return cow.Rows(pairs, self.weight.shape[0], base, self.selected, self.claims, self.tail)


def _race(lib: ctypes.CDLL, tables: list[_Table], seed: int) -> int:
    """Training thread: looks rows up, then updates them; background thread: copies every
    table in small random ranges, in a random order. Returns the rows copied in all."""
    bases = [0]
    for t in tables[:-1]:
        bases.append(bases[-1] + t.weight.shape[0] + 5)  # gaps: positions no shard holds
    group = cow.Group(lib, [t.args(b) for t, b in zip(tables, bases)])
    total = bases[-1] + tables[-1].weight.shape[0] + 5
    copied = [0, 0]
    stop = threading.Event()

    def background() -> None:
        rng = random.Random(seed)
        pieces = []
        for i, t in enumerate(tables):
            a = 0
            while a < t.n:
                b = min(t.n, a + rng.randint(1, 300))
                pieces.append((i, a, b))
                a = b
        rng.shuffle(pieces)
        for i, a, b in pieces:
            copied[0] += group.copy(i, tables[i].rows, a, b)
        stop.set()

    thread = threading.Thread(target=background)
    thread.start()
    rng = random.Random(seed + 1)
    while True:
        last = stop.is_set()
        rows = torch.tensor([rng.randrange(total) for _ in range(rng.randint(1, 200))])
        copied[1] += group.lookup(rows)  # from here on, the batch may update these rows
        for p in rows.tolist():
            for t, b in zip(tables, bases):
                if b <= p < b + t.weight.shape[0]:
                    t.weight[p - b] += 1.0
                    t.state[p - b] += 1.0
        if last:
            break
    thread.join()
    return copied[0] + copied[1]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("fraction", [1.0, 0.3, "tail"])
def test_racing_copiers_stage_every_row_once_as_it_was(
    lib: ctypes.CDLL, seed: int, strided: bool, fraction: float | str
) -> None:
    """``tail``: a cumulative delta, whose rows changed since the previous checkpoint are
    staged after the others (format 5)."""
    tail = fraction == "tail"
    share = 0.3 if tail else float(fraction)
    tables = [_Table(rows, 16, seed * 10 + i, strided, share, tail)
              for i, rows in enumerate((2000, 130, 777))]  # fmt: skip
    copied = _race(lib, tables, seed)
    assert copied == sum(t.n for t in tables), "a row was copied twice, or not at all"
    for t in tables:
        assert torch.equal(t.staged_weight, t.want[0])
        assert torch.equal(t.staged_state, t.want[1])
    live = [t.weight[slice(None) if t.rows is None else t.rows] for t in tables]
    assert any(not torch.equal(x, t.want[0]) for x, t in zip(live, tables)), "nothing raced"


def test_a_lookup_copies_held_rows_once_and_ignores_others(lib: ctypes.CDLL) -> None:
    t = _Table(100, 4, seed=1, strided=False, fraction=0.5)
    group = cow.Group(lib, [t.args(base=10)])
    assert t.rows is not None
    held = t.rows[:3] + 10
    outside = torch.tensor([0, 9, 110, 500])
    not_held = torch.tensor(sorted(set(range(100)) - set(t.rows.tolist()))[:3]) + 10
    rows = torch.cat([held, held, outside, not_held])  # duplicates included
    assert group.lookup(rows) == 3
    assert group.lookup(rows) == 0, "copied rows are not copied again"
    assert torch.equal(t.staged_weight[:3], t.want[0][:3])
    assert torch.count_nonzero(t.staged_weight[3:]) == 0
    assert group.copy(0, t.rows, 0, t.n) == t.n - 3
    assert torch.equal(t.staged_weight, t.want[0])


def test_bad_ranges_and_a_delta_without_its_rows_raise(lib: ctypes.CDLL) -> None:
    t = _Table(50, 4, seed=2, strided=False, fraction=0.5)
    group = cow.Group(lib, [t.args(base=0)])
    for a, b in ((-1, 3), (0, t.n + 1), (5, 4)):
        with pytest.raises(ValueError, match="rows"):
            group.copy(0, t.rows, a, b)
    with pytest.raises(ValueError, match="slot_rows"):
        group.copy(0, None, 0, t.n)
    assert torch.count_nonzero(t.staged_weight) == 0, "a refused copy wrote nothing"


def test_supports_only_cpu_rows_contiguous_in_memory_of_one_dtype() -> None:
    x = torch.zeros(10, 4)
    assert cow.supports([(x, torch.zeros(3, 4)), (torch.zeros(10), torch.zeros(3))])
    assert cow.supports([(torch.zeros(10, 6)[:, :4], torch.zeros(3, 4))])  # strided rows
    assert not cow.supports([(x.t(), torch.zeros(3, 10))])  # a column is not contiguous
    assert not cow.supports([(x, torch.zeros(3, 4, dtype=torch.float16))])
    assert not cow.supports([(x, torch.zeros(6, 4)[::2])])  # staged rows must be packed
    assert not cow.supports([(x, torch.zeros(3, 4))] * (cow.MAX_ARRAYS + 1))
    assert not cow.supports([(x.to("meta"), torch.zeros(3, 4))])


def test_the_switch_turns_the_library_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cow.library(False) is None
    assert StagingPool(compiled=False).copier is None
    monkeypatch.setenv("TORCHREC_CNR_COMPILED_STAGING", "0")
    assert not IOOptions().compiled_staging
    monkeypatch.setenv("TORCHREC_CNR_COMPILED_STAGING", "maybe")
    with pytest.raises(ValueError, match="TORCHREC_CNR_COMPILED_STAGING"):
        IOOptions()


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("n_words", [0, 1, 3, 1000])
def test_a_bitmap_snapshot_copies_and_counts_in_one_pass_as_torch_does(
    masked: bool, n_words: int
) -> None:
    # save() copies each delta's bitmap, and the set bits before each word, on the
    # training thread: one compiled pass, the same as the torch operations it replaces.
    g = torch.Generator().manual_seed(n_words)
    words = torch.randint(-(2**63), 2**63 - 1, (n_words,), generator=g, dtype=torch.int64)
    words[::7] = 0
    words[1::11] = -1  # every bit
    mask = torch.randint(-(2**63), 2**63 - 1, (n_words,), generator=g) if masked else None
    got = []
    for lib in (cow.library(), None):
        out, before = torch.full_like(words, 5), torch.full_like(words, 5)
        total = cow.snapshot_bits(lib, words, mask, out, before)
        got.append((out, before, total))
    assert cow.library() is not None
    (out, before, total), (t_out, t_before, t_total) = got
    want = words & mask if mask is not None else words
    assert torch.equal(out, want) and torch.equal(t_out, want)
    counts = bitmap.popcounts(want)
    assert torch.equal(before, torch.cumsum(counts, 0) - counts) and torch.equal(before, t_before)
    assert total == t_total == int(counts.sum())
