"""FsStorage's direct (``O_DIRECT``) and page-cache transfers give back the same bytes."""

from __future__ import annotations

import errno
import logging
import mmap
import os

import numpy as np
import pytest
import torch

from torchrec_cnr.iocontext import IOOptions
from torchrec_cnr.snapshot.checksum import as_bytes
from torchrec_cnr.snapshot.reader import page_aligned
from torchrec_cnr.storage import open_storage
from torchrec_cnr.storage.fs import FsStorage, _Direct

MIB = 1 << 20
# Around the direct threshold and the 4 KiB alignment, with aligned and odd tails.
SIZES = [0, 5000, MIB - 1, MIB, MIB + 1, 3 * MIB + 4097, _Direct.BOUNCE + 12345]


def _needs_o_direct(path) -> None:
    try:
        os.close(os.open(path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
    except OSError as e:
        pytest.skip(f"{path}'s file system refuses O_DIRECT ({e})")


def _read(st: FsStorage, name: str, offset: int, n: int) -> torch.Tensor:
    out = torch.empty(n, dtype=torch.uint8)
    st.read_into(name, offset, as_bytes(out) if n else memoryview(bytearray()))
    return out


@pytest.fixture(scope="module")
def source() -> torch.Tensor:
    return torch.randint(
        0, 256, (_Direct.BOUNCE * 2,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "page-cache"])
@pytest.mark.parametrize("shift", [0, 4096, 13], ids=["aligned", "page-shifted", "unaligned"])
def test_objects_round_trip_at_any_offset(tmp_path, source, direct, shift):
    if direct:
        _needs_o_direct(tmp_path)
    st = FsStorage(tmp_path, direct_writes=direct, direct_reads=direct)
    objects = {f"c/o{i}": source[shift + i : shift + i + n] for i, n in enumerate(SIZES)}
    for name, data in objects.items():
        st.write_object(name, as_bytes(data) if data.numel() else memoryview(b""))
    st.make_durable("c")
    for name, data in objects.items():
        n = data.numel()
        assert os.path.getsize(tmp_path / name) == n
        for offset in sorted({0, 1, 4095, 4096, n // 3}):
            length = max(0, n - offset - 7)
            assert torch.equal(_read(st, name, offset, length), data[offset : offset + length])
    assert st._direct.writes == direct  # this file system took O_DIRECT


def test_aligned_reads_go_straight_into_the_buffer_to_the_last_byte(tmp_path, source, monkeypatch):
    _needs_o_direct(tmp_path)
    n = 3 * MIB + 4097  # ends mid-page
    FsStorage(tmp_path).write_object("o", as_bytes(source[:n]))
    copied: list[int] = []  # bytes that passed through the bounce buffer, per copy
    real_copyto = np.copyto
    monkeypatch.setattr(
        np, "copyto", lambda dst, src: copied.append(len(src)) or real_copyto(dst, src)
    )
    st = FsStorage(tmp_path)
    for offset, length in [(0, 2 * MIB), (4096, MIB + 100), (0, n), (8192, n - 8192)]:
        buf = mmap.mmap(-1, length)  # page-aligned, as the staging pool's buffers are
        st.read_into("o", offset, memoryview(buf))
        got = torch.frombuffer(buf, dtype=torch.uint8)
        assert torch.equal(got, source[offset : offset + length]), (offset, length)
    assert copied == [100, 4097 - 4096, 4097 - 4096]  # only the tails under a page bounce
    st.read_into("o", 13, memoryview(mmap.mmap(-1, MIB)))  # an unaligned offset bounces
    assert sum(copied[3:]) == MIB


def test_a_buffer_at_the_offsets_phase_bounces_only_its_first_partial_block(
    tmp_path, source, monkeypatch
):
    """``page_aligned(phase=offset)`` lies as far from a block boundary as the bytes read
    into it: the first partial block bounces, the rest goes straight in, any length."""
    _needs_o_direct(tmp_path)
    n = 3 * MIB + 4097
    FsStorage(tmp_path).write_object("o", as_bytes(source[:n]))
    copied: list[int] = []
    real_copyto = np.copyto
    monkeypatch.setattr(
        np, "copyto", lambda dst, src: copied.append(len(src)) or real_copyto(dst, src)
    )
    st = FsStorage(tmp_path)
    for offset, length in [(13, 2 * MIB), (4095, MIB + 7), (5000, n - 5000)]:
        copied.clear()
        out = page_aligned(length, torch.uint8, phase=offset)
        st.read_into("o", offset, as_bytes(out))
        assert torch.equal(out, source[offset : offset + length]), (offset, length)
        head = -offset % 4096
        tail = (length - head) % 4096
        assert copied == [head] + ([tail] if tail else []), (offset, length, copied)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "page-cache"])
def test_a_read_past_the_end_fails_with_the_missing_bytes(tmp_path, source, direct):
    st = FsStorage(tmp_path, direct_writes=direct, direct_reads=direct)
    st.write_object("o", as_bytes(source[: 2 * MIB + 5]))
    needs = rf"holds {2 * MIB + 5} bytes, fewer than the {2 * MIB + 105} this read needs"
    with pytest.raises(OSError, match=needs):
        _read(st, "o", MIB, MIB + 105)
    # A read that starts past the end names the file's real length too.
    with pytest.raises(OSError, match=rf"holds {2 * MIB + 5} bytes, .* \(bytes {3 * MIB} to"):
        _read(st, "o", 3 * MIB, 4096)


def test_large_objects_go_direct_and_small_ones_through_the_page_cache(
    tmp_path, source, monkeypatch
):
    _needs_o_direct(tmp_path)
    opened: list[tuple[str, bool]] = []
    real_open = os.open

    def spy(path, flags, *args):
        opened.append((os.path.basename(path), bool(flags & os.O_DIRECT)))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", spy)
    st = FsStorage(tmp_path)  # the defaults
    st.write_object("big", as_bytes(source[: 2 * MIB]))
    st.write_object("small", as_bytes(source[: MIB - 1]))
    _read(st, "big", 0, 2 * MIB)
    _read(st, "small", 0, MIB - 1)
    assert opened == [("big", True), ("small", False), ("big", True), ("small", False)]


def test_a_file_system_that_refuses_o_direct_falls_back_once_and_loses_nothing(
    tmp_path, source, monkeypatch, caplog
):
    real_open = os.open
    refusals = []

    def refusing(path, flags, *args):
        if flags & os.O_DIRECT:
            refusals.append(path)
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing)
    st = FsStorage(tmp_path, direct_writes=True, direct_reads=True)
    with caplog.at_level(logging.INFO, logger="torchrec_cnr.storage.fs"):
        for i in range(3):
            st.write_object(f"o{i}", as_bytes(source[i : i + 2 * MIB]))
    for i in range(3):
        assert torch.equal(_read(st, f"o{i}", 0, 2 * MIB), source[i : i + 2 * MIB])
    assert len(refusals) == 1 and not st._direct.writes and not st._direct.reads
    assert sum("O_DIRECT refused" in r.message for r in caplog.records) == 1


def test_other_errors_of_a_direct_write_are_raised(tmp_path, source, monkeypatch):
    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    st = FsStorage(tmp_path, direct_writes=True)
    with pytest.raises(OSError) as e:
        st.write_object("o", as_bytes(source[: 2 * MIB]))
    assert e.value.errno == errno.ENOSPC and st._direct.writes


def test_environment_switches(tmp_path, monkeypatch):
    def opened(options: IOOptions | None = None) -> FsStorage:
        st = open_storage(str(tmp_path), options)
        assert isinstance(st, FsStorage)
        return st

    assert (opened()._direct.writes, opened()._direct.reads) == (True, True)
    for writes, reads in ((0, 1), (1, 0), (0, 0)):
        monkeypatch.setenv("TORCHREC_CNR_DIRECT_WRITES", str(writes))
        monkeypatch.setenv("TORCHREC_CNR_DIRECT_READS", str(reads))
        st = opened()
        assert (st._direct.writes, st._direct.reads) == (bool(writes), bool(reads))
    assert opened(IOOptions(direct_writes=True))._direct.writes  # an argument wins
    monkeypatch.setenv("TORCHREC_CNR_DIRECT_WRITES", "maybe")
    with pytest.raises(ValueError, match="TORCHREC_CNR_DIRECT_WRITES='maybe': use 1 or 0"):
        opened()
