"""The compiled CRC32 (``snapshot/_crc32.c``) against zlib's, which stored checksums are."""

from __future__ import annotations

import random
import threading
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from torchrec_cnr.snapshot import checksum
from torchrec_cnr.snapshot.checksum import crc32, crc32_bytes

_P = 0x104C11DB7  # x^32 + x^26 + ... + 1


def _lib():  # type: ignore[no-untyped-def]
    # The project's setup (pip install -e .) builds it: a missing library fails here
    # rather than skipping (without one, crc32_bytes is zlib's own).
    lib = checksum._library()
    assert lib is not None, "the compiled CRC32 is not built: run make setup"
    return lib


def _fn():  # type: ignore[no-untyped-def]
    return _lib().cnr_crc32


def _x_mod_p(e: int) -> int:
    r = 1
    for _ in range(e):
        r <<= 1
        if r >> 32 & 1:
            r ^= _P
    return r


def _reflect(v: int, bits: int) -> int:
    return int(f"{v:0{bits}b}"[::-1], 2)


def test_the_fold_constants_are_powers_of_x_modulo_the_polynomial() -> None:
    source = (Path(checksum.__file__).parent / "_crc32.c").read_text()
    # Each fold constant is x^e mod P, reflected, shifted into the multiplier's frame.
    for e in (1024 + 32, 1024 - 32, 128 + 32, 128 - 32, 64):
        assert f"{_reflect(_x_mod_p(e), 32) << 1:#x}ull" in source, e
    quotient, num = 0, 1 << 64  # x^64 / P, for the Barrett reduction
    while num.bit_length() >= 33:
        shift = num.bit_length() - 33
        quotient |= 1 << shift
        num ^= _P << shift
    assert f"{_reflect(quotient, 33):#x}ull" in source
    assert f"{_reflect(_P, 33):#x}ull" in source


def test_equals_zlib_at_every_length_offset_and_starting_value() -> None:
    fn = _fn()
    rng = random.Random(0)
    data = np.frombuffer(rng.randbytes(1 << 20), dtype=np.uint8)
    base = data.ctypes.data
    lengths = [*range(0, 400), *(rng.randrange(400, 1 << 19) for _ in range(200))]
    for n in lengths:
        offset = rng.randrange(0, 64)
        start = 0 if n % 3 else rng.getrandbits(32)
        want = zlib.crc32(data[offset : offset + n].tobytes(), start)
        assert fn(start, base + offset, n) == want, (n, offset, start)


def test_crc32_bytes_takes_every_buffer_and_continues_like_zlib() -> None:
    rng = random.Random(1)
    blob = rng.randbytes(3 * 4096 + 17)
    for data in (blob, bytearray(blob), memoryview(blob), memoryview(blob)[5:]):
        assert crc32_bytes(data) == zlib.crc32(data)
        assert crc32_bytes(data, 0xDEADBEEF) == zlib.crc32(data, 0xDEADBEEF)
    head, tail = blob[:5000], blob[5000:]
    assert crc32_bytes(tail, crc32_bytes(head)) == zlib.crc32(blob)
    t = torch.randn(300, 70)  # also strided and bf16 tensors, through their bytes
    for value in (t, t[:, ::2], t.to(torch.bfloat16)):
        assert crc32(value) == zlib.crc32(value.contiguous().view(torch.uint8).numpy().tobytes())


def test_large_inputs_go_through_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    fn, calls = _fn(), []

    def counted(*args: int) -> int:
        calls.append(args[2])
        return int(fn(*args))

    monkeypatch.setattr(checksum, "_library", lambda: SimpleNamespace(cnr_crc32=counted))
    data = random.Random(2).randbytes(1 << 16)
    assert crc32_bytes(data) == zlib.crc32(data)
    assert crc32_bytes(data[:100]) == zlib.crc32(data[:100])  # small: zlib, no call
    assert calls == [1 << 16]


def test_threads_at_once_agree() -> None:
    data = random.Random(3).randbytes(4 << 20)
    want = zlib.crc32(data)
    got: list[int] = []
    threads = [threading.Thread(target=lambda: got.append(crc32_bytes(data))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [want] * 4


def test_the_compiled_combine_is_the_crc32_of_the_concatenation() -> None:
    lib = _lib()
    rng = random.Random(4)
    for _ in range(200):
        a, b = rng.randbytes(rng.randrange(0, 3000)), rng.randbytes(rng.randrange(0, 3000))
        got = lib.cnr_crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b))
        assert got == zlib.crc32(a + b)
        assert checksum.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == got


def test_the_compiled_combine_equals_the_python_one_at_any_length() -> None:
    lib = _lib()
    rng = random.Random(5)
    lengths = [1, 7, 4096, 64 << 20, (64 << 20) + 3, 1 << 40, 2**62 + 12345]
    for length in lengths + [rng.randrange(1, 1 << 48) for _ in range(20)]:
        first, second = rng.getrandbits(32), rng.getrandbits(32)
        want = checksum._times(checksum._shift(length), first) ^ second
        assert lib.cnr_crc32_combine(first, second, length) == want, length
    assert lib.cnr_crc32_combine(1, 2, -1) == -1
    with pytest.raises(ValueError, match="second_length"):
        checksum.crc32_combine(1, 2, -1)


def test_without_the_library_the_combine_runs_in_python(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checksum, "_library", lambda: None)
    a, b = b"x" * 5000, b"yz" * 700
    assert checksum.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    assert checksum.crc32_combine(0, zlib.crc32(b), len(b)) == zlib.crc32(b)
