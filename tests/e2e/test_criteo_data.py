"""Real Criteo files: the reader against TSV files the tests write, and a torchrun job on one
(killed mid-commit, in torchtitan's option names, and uninterrupted)."""

from __future__ import annotations

import json
import math
import os
import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from cnr_train import criteo
from cnr_train.workload import criteo_tables
from tests.e2e.test_restarts import assert_failed_run_matches, clean_run
from tests.e2e.test_train_script import SMALL
from torchrec_cnr.manifest import Manifest

ROWS = 300  # table cap used by the reader tests
TITAN = (
    *(o for o in SMALL if not o.startswith("checkpoint.interval_steps=")),
    "checkpoint.interval_steps=null",
    "checkpoint.interval=20",
    "checkpoint.keep_latest_k=2",
    "checkpoint.async_mode=async",
)
"""The app's options (:data:`SMALL`) with its checkpoint section in torchtitan's names."""


def _write_tsv(path: Path, n: int, seed: int = 0) -> list[list[str]]:
    """Criteo-shaped lines: empties, negative counts, 8-digit hashes; labels follow C1."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        dense = ["" if rng.random() < 0.1 else str(rng.randint(-3, 10_000)) for _ in range(13)]
        cats = ["" if rng.random() < 0.1 else f"{rng.getrandbits(32):08x}" for _ in range(26)]
        # A learnable label: C1's hash decides it, with some noise.
        signal = int(cats[0] or "0", 16) % 2
        label = signal if rng.random() < 0.85 else 1 - signal
        lines.append([str(label), *dense, *cats])
    path.write_text("".join("\t".join(line) + "\n" for line in lines))
    return lines


def _expected(line: list[str]) -> tuple[float, list[float], list[int]]:
    dense = [math.log1p(max(int(v or "0"), 0)) for v in line[1:14]]
    tables = criteo_tables(ROWS, 8)
    ids = [int(v or "0", 16) % t.rows for v, t in zip(line[14:], tables, strict=True)]
    return float(line[0]), dense, ids


def _check_batch(batch, lines: list[list[str]]) -> None:
    per_feature = batch.sparse.to_dict()
    for i, line in enumerate(lines):
        label, dense, ids = _expected(line)
        assert batch.labels[i].item() == label
        torch.testing.assert_close(batch.dense[i], torch.tensor(dense), rtol=1e-6, atol=1e-6)
        got = [per_feature[f"f_cat_{j}"].values()[i].item() for j in range(26)]
        assert got == ids


def test_batches_hold_the_file_samples_by_rank_and_step_and_wrap(tmp_path: Path) -> None:
    lines = _write_tsv(tmp_path / "day_0", 70)
    files = criteo.convert(str(tmp_path / "day_0"), tmp_path / "cache", progress=False)
    data = criteo.CriteoBatches(files, criteo_tables(ROWS, 8), 4, 2, heldout_rows=6)
    assert data.samples == 64
    # Step s, rank r reads samples ((s-1)*2 + r)*4 .. +4 of the 64 training samples.
    _check_batch(data.batch(0, 1), lines[0:4])
    _check_batch(data.batch(1, 1), lines[4:8])
    _check_batch(data.batch(1, 3), lines[20:24])
    # Step 8 is the last of the first pass; step 9 starts over at sample 0.
    _check_batch(data.batch(1, 8), lines[60:64])
    _check_batch(data.batch(0, 9), lines[0:4])
    # The held-out tail (6 samples) is never trained on; its batches wrap within it.
    _check_batch(data.heldout(0, 0), lines[64:68])
    _check_batch(data.heldout(1, 0), [*lines[68:70], *lines[64:66]])


def test_files_are_read_in_natural_order_as_one_stream_with_a_separate_eval_file(
    tmp_path: Path,
) -> None:
    day2 = _write_tsv(tmp_path / "day_2", 5, seed=2)
    day10 = _write_tsv(tmp_path / "day_10", 5, seed=10)
    held = _write_tsv(tmp_path / "heldout", 8, seed=3)
    cache = tmp_path / "cache"
    train = criteo.convert(str(tmp_path / "day_*"), cache, progress=False)
    data = criteo.CriteoBatches(
        train, criteo_tables(ROWS, 8), 4, 1, criteo.convert(str(tmp_path / "heldout"), cache)
    )
    assert data.samples == 10
    _check_batch(data.batch(0, 2), [*day2[4:5], *day10[0:3]])  # across the file boundary
    _check_batch(data.heldout(0, 1), held[4:8])


def test_conversion_is_cached_and_redone_when_the_file_changes(tmp_path: Path) -> None:
    src, cache = tmp_path / "train.txt", tmp_path / "cache"
    _write_tsv(src, 20)
    (first,) = criteo.convert(str(src), cache, progress=False)
    marker = Path(f"{first.stem}.json")
    written = marker.stat().st_mtime_ns
    (again,) = criteo.convert(str(src), cache, progress=False)
    assert again == first and marker.stat().st_mtime_ns == written, "a valid cache is reused"

    lines = _write_tsv(src, 30, seed=9)
    os.utime(src, ns=(written + 10**9, written + 10**9))
    (redone,) = criteo.convert(str(src), cache, progress=False)
    assert redone.rows == 30 and json.loads(marker.read_text())["rows"] == 30
    data = criteo.CriteoBatches([redone], criteo_tables(ROWS, 8), 2, 1, heldout_rows=2)
    _check_batch(data.batch(0, 1), lines[0:2])


@pytest.mark.parametrize(
    "mutate,needle",
    [
        (lambda line: line[:-1], "got 39 (Kaggle's test.txt has no labels)"),
        (lambda line: ["2", *line[1:]], "label must be 0 or 1"),
        (lambda line: [*line[:3], "x7", *line[4:]], "invalid literal"),
        (lambda line: [*line[:20], "zz", *line[21:]], "invalid literal"),
    ],
)
def test_malformed_line_is_named_and_leaves_no_cache(tmp_path: Path, mutate, needle: str) -> None:
    src, cache = tmp_path / "train.txt", tmp_path / "cache"
    lines = _write_tsv(src, 9)
    lines[6] = mutate(lines[6])
    src.write_text("".join("\t".join(line) + "\n" for line in lines))
    with pytest.raises(
        criteo.CriteoFormatError, match=rf"train\.txt, line 7: .*{re.escape(needle)}"
    ):
        criteo.convert(str(src), cache, progress=False)
    assert list(cache.iterdir()) == [], "a failed conversion must leave nothing behind"


def test_missing_files_and_empty_globs_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no file .*day_0"):
        criteo.convert(str(tmp_path / "day_0"), tmp_path / "cache")
    with pytest.raises(FileNotFoundError, match=r"day_\*' matches no file"):
        criteo.convert(str(tmp_path / "day_*"), tmp_path / "cache")


def test_too_few_samples_for_one_step_after_holding_out_is_refused(tmp_path: Path) -> None:
    _write_tsv(tmp_path / "train.txt", 40)
    files = criteo.convert(str(tmp_path / "train.txt"), tmp_path / "cache", progress=False)
    with pytest.raises(ValueError, match="set data.eval_path or lower eval.batches"):
        criteo.CriteoBatches(files, criteo_tables(ROWS, 8), 16, 2, heldout_rows=16)


@pytest.fixture(scope="module")
def criteo_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The app (:data:`SMALL`) on a Criteo-format file: run uninterrupted in our option
    names, then with rank 1 SIGKILLed right after the save of step 40 returned, in
    torchtitan's names (:data:`TITAN`), each on a root of its own. Asserts that the killed
    run resumed from step 20 and ends in the clean run's state, bit for bit
    (:func:`assert_failed_run_matches`); returns its folder (roots ``a`` and ``b``) and the
    clean run's metrics and stdout. One killed run serves both tests below: the names
    change where and how the job checkpoints, not what it trains or reads."""
    folder = tmp_path_factory.mktemp("criteo_job")
    src = folder / "train.txt"
    _write_tsv(src, 12_000)
    data = (f"data.path={src}", f"data.cache_dir={folder / 'cache'}")
    clean = clean_run(folder, *SMALL, *data)
    assert_failed_run_matches(folder, clean, *TITAN, *data)
    return folder, clean


@pytest.mark.dist
@pytest.mark.timeout(600)  # the first to run starts both jobs (criteo_job)
def test_criteo_file_job_with_injected_failure_ends_bit_identical_to_uninterrupted(
    criteo_job: tuple[Path, dict[str, Any]],
) -> None:
    """The killed run (:func:`criteo_job`) resumed from step 20 and ended bit-identical to
    the uninterrupted one: the reader's position in the file is restored with the model."""
    _, clean = criteo_job
    assert "criteo: 9952 training samples" in clean["stdout"]
    assert "restore check: step 60 into a fresh model: bit-exact" in clean["stdout"]
    assert clean["auc"] > 0.6, "labels follow C1's hash: a model that learns beats chance"


@pytest.mark.dist
@pytest.mark.timeout(600)  # the first to run starts both jobs (criteo_job)
def test_the_app_configured_in_torchtitans_option_names_resumes_bit_identical(
    criteo_job: tuple[Path, dict[str, Any]],
) -> None:
    """The job with its checkpoint section in torchtitan's names (interval, keep_latest_k,
    async_mode), killed mid-commit: it resumed and ended as the clean run (the same job in
    our names), and keeps the latest 2 checkpoints."""
    folder, _ = criteo_job
    assert Manifest.load(folder / "b").steps()[-2:] == [40, 60]
