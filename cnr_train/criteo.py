"""Real Criteo click logs (Kaggle or Terabyte) for the training job.

Both data sets are tab-separated text, one sample per line, 40 columns:

- ``label``: 0 or 1;
- 13 integer features (counts; may be empty or negative);
- 26 categorical features, each a 32-bit hash in hex (may be empty).

Kaggle ships ``train.txt`` (its ``test.txt`` has no labels and is refused);
Terabyte ships ``day_0`` ... ``day_23`` (decompress them first).

Each file is streamed once through ``torchrec.datasets.criteo`` and converted
into three memory-mapped ``.npy`` arrays in ``cache_dir``, with the shapes and
dtypes of torchrec's ``BinaryCriteoUtils``:

- ``<name>_dense.npy``: ``(N, 13)`` float32, ``log(1 + max(x, 0))`` as in the
  DLRM reference;
- ``<name>_sparse.npy``: ``(N, 26)`` int64 hashes (empty: 0);
- ``<name>_labels.npy``: ``(N, 1)`` int32.

A ``<name>.json`` written last marks the conversion complete. It records the
source file's size and mtime, so an edited file is converted again. Batches
are then a pure function of ``(rank, step)``: step ``s`` of a world of ``W``
ranks reads samples ``[(s - 1) * W * B, s * W * B)``, rank ``r`` the ``r``-th
slice of ``B``, wrapping at the end of the data, so a resumed job reads
exactly what an uninterrupted one would. Id ``h`` of feature ``j`` looks up
row ``h mod rows_j`` of table ``j``.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torchrec import KeyedJaggedTensor
from torchrec.datasets.criteo import CAT_FEATURE_COUNT, INT_FEATURE_COUNT, criteo_terabyte
from tqdm import tqdm

from cnr_train.workload import Batch, BatchStream, TableSpec

__all__ = ["ConvertedFile", "CriteoBatches", "CriteoFormatError", "convert", "expand_paths"]

_COLUMNS = 1 + INT_FEATURE_COUNT + CAT_FEATURE_COUNT
_CHUNK_ROWS = 1 << 16
_ARRAYS = ("dense", "sparse", "labels")


class CriteoFormatError(ValueError):
    """A Criteo file is not 40 tab-separated columns of the expected types."""


def expand_paths(patterns: str | Sequence[str]) -> list[Path]:
    """Files named by ``patterns`` (paths or globs), each glob sorted naturally.

    Raises:
        FileNotFoundError: a path does not exist or a glob matches nothing.
    """
    found: list[Path] = []
    for pattern in [patterns] if isinstance(patterns, str) else patterns:
        if glob.has_magic(pattern):
            matches = sorted(glob.glob(pattern), key=_natural_key)
            if not matches:
                raise FileNotFoundError(f"Criteo data: {pattern!r} matches no file")
            found.extend(Path(m) for m in matches)
        elif Path(pattern).is_file():
            found.append(Path(pattern))
        else:
            raise FileNotFoundError(f"Criteo data: no file {pattern!r}")
    return found


def _natural_key(name: str) -> list[object]:
    # day_2 before day_10
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


@dataclass(frozen=True)
class ConvertedFile:
    """The cached arrays of one source file."""

    stem: Path
    """``cache_dir/<name>``; the arrays are ``<stem>_dense.npy`` etc."""
    rows: int

    def array(self, kind: str) -> np.ndarray:
        return np.load(f"{self.stem}_{kind}.npy", mmap_mode="r")


def _cache_stem(source: Path, cache_dir: Path) -> Path:
    # Two sources of one name (a/train.txt, b/train.txt) must not share a cache entry.
    digest = hashlib.sha1(str(source.resolve()).encode()).hexdigest()[:8]
    return cache_dir / f"{source.name}-{digest}"


def _fingerprint(source: Path) -> dict[str, object]:
    st = source.stat()
    return {"source": str(source.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _cached(source: Path, cache_dir: Path) -> ConvertedFile | None:
    stem = _cache_stem(source, cache_dir)
    try:
        meta = json.loads(Path(f"{stem}.json").read_text())
    except (OSError, ValueError):
        return None
    if meta.get("fingerprint") != _fingerprint(source):
        return None
    return ConvertedFile(stem, int(meta["rows"]))


def _count_lines(source: Path) -> int:
    lines, last = 0, b"\n"
    with open(source, "rb") as f:
        while block := f.read(1 << 24):
            lines += block.count(b"\n")
            last = block[-1:]
    return lines + (last != b"\n")


def _parse_row(row: list[str], where: str) -> tuple[int, list[int], list[int]]:
    if len(row) != _COLUMNS:
        hint = " (Kaggle's test.txt has no labels)" if len(row) == _COLUMNS - 1 else ""
        raise CriteoFormatError(
            f"{where}: expected {_COLUMNS} tab-separated columns (label, {INT_FEATURE_COUNT} "
            f"integer, {CAT_FEATURE_COUNT} categorical), got {len(row)}{hint}"
        )
    try:
        label = int(row[0])
        dense = [int(v) if v else 0 for v in row[1 : 1 + INT_FEATURE_COUNT]]
        sparse = [int(v, 16) if v else 0 for v in row[1 + INT_FEATURE_COUNT :]]
    except ValueError as e:
        raise CriteoFormatError(f"{where}: {e}") from e
    if label not in (0, 1):
        raise CriteoFormatError(f"{where}: label must be 0 or 1, got {row[0]!r}")
    return label, dense, sparse


def _parse_chunk(rows: list[list[str]], where: str, first_line: int) -> dict[str, np.ndarray]:
    """``rows`` as ``(n, 13)`` dense, ``(n, 26)`` sparse and ``(n, 1)`` labels arrays.

    Vectorized for well-formed rows (every hash 8 hex digits, as Criteo writes
    them); anything else goes through the row parser, which names the bad line.
    """
    try:
        if any(len(r) != _COLUMNS for r in rows):
            raise ValueError
        text = np.array(rows)
        if not np.isin(text[:, 0], ("0", "1")).all():
            raise ValueError
        dense_text = text[:, 1 : 1 + INT_FEATURE_COUNT]
        dense_text[dense_text == ""] = "0"
        dense = dense_text.astype(np.int64)
        hashes = text[:, 1 + INT_FEATURE_COUNT :]
        hashes[hashes == ""] = "00000000"
        if (np.char.str_len(hashes) != 8).any():
            raise ValueError
        sparse = np.frombuffer(bytes.fromhex("".join(hashes.ravel())), dtype=">u4")
        labels = text[:, :1].astype(np.int64)
    except ValueError:
        parsed = [_parse_row(r, f"{where}, line {first_line + i}") for i, r in enumerate(rows)]
        labels = np.array([[p[0]] for p in parsed], dtype=np.int64)
        dense = np.array([p[1] for p in parsed], dtype=np.int64)
        sparse = np.array([p[2] for p in parsed], dtype=np.int64)
    return {
        "dense": np.log1p(np.maximum(dense, 0)).astype(np.float32),
        "sparse": sparse.reshape(len(rows), CAT_FEATURE_COUNT).astype(np.int64),
        "labels": labels.astype(np.int32),
    }


def _convert_one(source: Path, cache_dir: Path, progress: bool) -> ConvertedFile:
    stem = _cache_stem(source, cache_dir)
    rows = _count_lines(source)
    if rows == 0:
        raise CriteoFormatError(f"{source}: empty file")
    # Unique temporaries: two converters sharing a cache (one per node) never clash,
    # and a killed conversion leaves no array that looks complete.
    tmp = f".tmp-{os.uname().nodename}-{os.getpid()}"
    paths = {k: Path(f"{stem}_{k}.npy{tmp}") for k in _ARRAYS}
    widths = {"dense": INT_FEATURE_COUNT, "sparse": CAT_FEATURE_COUNT, "labels": 1}
    dtypes = {"dense": np.float32, "sparse": np.int64, "labels": np.int32}
    try:
        out = {
            k: np.lib.format.open_memmap(paths[k], "w+", dtypes[k], (rows, widths[k]))
            for k in _ARRAYS
        }
        bar = tqdm(total=rows, desc=f"criteo: {source.name}", unit="row", disable=not progress)
        done = 0

        def write(chunk: list[list[str]]) -> None:
            nonlocal done
            if done + len(chunk) > rows:
                raise CriteoFormatError(f"{source}: more samples than its {rows} lines")
            for k, a in _parse_chunk(chunk, str(source), done + 1).items():
                out[k][done : done + len(chunk)] = a
            done += len(chunk)
            bar.update(len(chunk))

        chunk: list[list[str]] = []
        for row in criteo_terabyte((str(source),), row_mapper=None):
            chunk.append(row)
            if len(chunk) == _CHUNK_ROWS:
                write(chunk)
                chunk = []
        if chunk:
            write(chunk)
        bar.close()
        if done != rows:
            raise CriteoFormatError(f"{source}: read {done} samples from {rows} lines")
        for a in out.values():
            a.flush()
        out.clear()  # unmap before the arrays take their final names
        for k in _ARRAYS:
            os.replace(paths[k], f"{stem}_{k}.npy")
        # IMPORTANT: the marker goes last; it is what makes the cached arrays valid.
        meta = {"fingerprint": _fingerprint(source), "rows": rows}
        marker = Path(f"{stem}.json{tmp}")
        marker.write_text(json.dumps(meta))
        os.replace(marker, f"{stem}.json")
    finally:
        for p in [*paths.values(), Path(f"{stem}.json{tmp}")]:
            p.unlink(missing_ok=True)
    return ConvertedFile(stem, rows)


def convert(
    patterns: str | Sequence[str],
    cache_dir: str | Path,
    converter: bool = True,
    progress: bool = True,
) -> list[ConvertedFile]:
    """Converts Criteo TSV files to cached ``.npy`` arrays, reusing a valid cache.

    Args:
        patterns: files or globs, e.g. ``"/data/criteo/day_*"``.
        cache_dir: where the arrays go; shared between ranks (and jobs).
        converter: ``True`` on the one process per cache that converts; the
            others wait for its markers. Under torchrun, a converter that fails
            takes the job down, so the waiters never hang.
        progress: a progress bar per converted file.

    Raises:
        FileNotFoundError: a path or glob names no file.
        CriteoFormatError: a line is malformed; the message names file and line.
    """
    sources = expand_paths(patterns)
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    converted = []
    for source in sources:
        entry = _cached(source, cache)
        if entry is None and converter:
            entry = _convert_one(source, cache, progress)
        while entry is None:
            time.sleep(0.5)
            entry = _cached(source, cache)
        converted.append(entry)
    return converted


class _Rows:
    """Samples ``[start, stop)`` of the concatenated files, gathered by index."""

    def __init__(self, files: Sequence[ConvertedFile], start: int = 0, stop: int | None = None):
        self._arrays = {k: [f.array(k) for f in files] for k in _ARRAYS}
        self._offsets = np.cumsum([0, *(f.rows for f in files)])
        self.start = start
        self.stop = int(self._offsets[-1]) if stop is None else stop

    def __len__(self) -> int:
        return self.stop - self.start

    def take(self, first: int, n: int) -> dict[str, np.ndarray]:
        """``n`` samples from position ``first``, wrapping at the end."""
        idx = self.start + (first + np.arange(n)) % len(self)
        which = np.searchsorted(self._offsets, idx, side="right") - 1
        out = {}
        for k, arrays in self._arrays.items():
            parts = np.empty((n, arrays[0].shape[1]), dtype=arrays[0].dtype)
            for f in np.unique(which):
                mask = which == f
                parts[mask] = arrays[f][idx[mask] - self._offsets[f]]
            out[k] = parts
        return out


class CriteoBatches(BatchStream):
    """Batches of real Criteo samples, a pure function of ``(rank, step)``.

    Args:
        train: converted training files, in order.
        tables: the 26 tables, feature ``j`` on table ``j`` (see ``criteo_tables``).
        batch_size: samples per rank per step.
        world_size: ranks reading the stream.
        heldout: converted held-out files; ``None`` holds out the last
            ``heldout_rows`` samples of ``train``.
        heldout_rows: samples held out of ``train`` when ``heldout`` is ``None``.

    Raises:
        ValueError: too few samples for one training step after holding out.
    """

    def __init__(
        self,
        train: Sequence[ConvertedFile],
        tables: Sequence[TableSpec],
        batch_size: int,
        world_size: int,
        heldout: Sequence[ConvertedFile] | None = None,
        heldout_rows: int = 0,
    ) -> None:
        super().__init__()
        if len(tables) != CAT_FEATURE_COUNT:
            raise ValueError(
                f"Criteo has {CAT_FEATURE_COUNT} categorical features; got {len(tables)} tables"
            )
        self.tables = list(tables)
        self.batch_size = batch_size
        self.world_size = world_size
        self._train = _Rows(train)
        total = len(self._train)
        if heldout:
            self._heldout = _Rows(heldout)
        else:
            self._heldout = _Rows(train, total - heldout_rows, total)
            self._train = _Rows(train, 0, total - heldout_rows)
        if len(self._train) < batch_size * world_size or len(self._heldout) == 0:
            raise ValueError(
                f"data.path holds {total} samples; holding out {heldout_rows} leaves "
                f"{len(self._train)} for training, fewer than one step of "
                f"{world_size} x {batch_size}: set data.eval_path or lower eval.batches"
            )
        self._rows = torch.tensor([t.rows for t in self.tables], dtype=torch.int64)

    @property
    def samples(self) -> int:
        """Training samples (one epoch)."""
        return len(self._train)

    def batch(self, rank: int, step: int) -> Batch:
        first = ((step - 1) * self.world_size + rank) * self.batch_size
        return self._to_batch(self._train.take(first, self.batch_size))

    def heldout(self, rank: int, index: int) -> Batch:
        first = (index * self.world_size + rank) * self.batch_size
        return self._to_batch(self._heldout.take(first, self.batch_size))

    def epochs(self, steps: int) -> float:
        """Passes over the training samples that ``steps`` steps make."""
        return steps * self.world_size * self.batch_size / self.samples

    def _to_batch(self, arrays: dict[str, np.ndarray]) -> Batch:
        ids = torch.from_numpy(arrays["sparse"]) % self._rows  # (B, 26)
        n = ids.shape[0]
        sparse = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f_{t.name}" for t in self.tables],
            values=ids.t().reshape(-1),  # feature-major, as KJT lays out its keys
            lengths=torch.ones(n * len(self.tables), dtype=torch.int32),
        )
        dense = torch.from_numpy(arrays["dense"])
        labels = torch.from_numpy(arrays["labels"][:, 0]).float()
        return Batch(dense, sparse, labels)

    def _identity(self) -> dict[str, int]:
        return {"samples": self.samples}
