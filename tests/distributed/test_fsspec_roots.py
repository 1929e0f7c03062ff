"""fsspec roots as users give them: options in the config (not the environment), a store
that ignores conditional writes refused unless one writer is declared, wrong credentials
and an unreachable endpoint failing every rank alike before the first step, and the
``cnr`` tool and a follower reading the same root with the same options."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from cnr_train import config_file
from cnr_train.config import JobConfig
from cnr_train.serve import serving_model
from cnr_train.workload import TableSpec
from tests.jobs import make_job, restores_exactly, save_reference
from tests.multiprocess import run_ranks
from torchrec_cnr import CheckpointError, FollowerOptions, Timeouts
from torchrec_cnr.cli import main as cnr
from torchrec_cnr.manifest import Manifest
from torchrec_cnr.offline import export_state_dict
from torchrec_cnr.serving import FloatTarget, Follower
from torchrec_cnr.storage import open_storage
from torchrec_cnr.storage.remote import FsspecStorage

TABLES = [
    TableSpec("t_small", 50, 4, "table_wise"),
    TableSpec("t_rows", 200, 4, "row_wise"),
]


def _options_from_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The store's options, taken out of the environment the root fixture set, so that
    only the config carries them."""
    options: dict[str, Any] = json.loads(os.environ["TORCHREC_CNR_STORAGE_OPTIONS"])
    monkeypatch.delenv("TORCHREC_CNR_STORAGE_OPTIONS")
    return options


def _every_rank_refused(root: str, config: dict[str, Any], needle: str) -> None:
    job = make_job(TABLES, seed=3, data_seed=4)  # planning is not part of the wait
    dist.barrier()
    began = time.monotonic()
    with pytest.raises(CheckpointError, match=needle) as info:
        job.attach(
            root, policy="consecutive", timeouts=Timeouts(collective_timeout_s=120), **config
        )
    waited = time.monotonic() - began
    messages: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, str(info.value))
    assert len(set(messages)) == 1, f"every rank fails with the same message: {messages}"
    assert waited < 60, "no rank waits for a collective to time out"


def _saves_and_restores(root: str, refs: str, config: dict[str, Any]) -> None:
    job = make_job(TABLES, root, seed=1, data_seed=4, policy="consecutive", **config)
    for step in (2, 4):
        job.train(2)
        job.ckpt.save(step)
        save_reference(job, refs, step)
    job.ckpt.close()


@pytest.mark.dist
@pytest.mark.parametrize("fsspec_root", ["lax_gcs"], indirect=True)
def test_a_store_that_ignores_conditional_writes_is_refused_unless_one_writer_is_declared(
    fsspec_root: str, refs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The stock gcp-storage-emulator accepts ifGenerationMatch and ignores it.
    options = _options_from_env(monkeypatch)
    config: dict[str, Any] = {"storage_options": options}
    run_ranks(2, _every_rank_refused, fsspec_root, config, "ignores conditional writes")
    assert not open_storage(fsspec_root, storage_options=options).children(), "nothing written"
    config.update(single_writer=True, background="process")  # the writer process too
    run_ranks(2, _saves_and_restores, fsspec_root, str(refs), config)
    run_ranks(2, restores_exactly, TABLES, fsspec_root, str(refs), 4, latest=True, seed=9,
              data_seed=4, **config)  # fmt: skip


@pytest.mark.dist
@pytest.mark.parametrize("fsspec_root", ["azure", "s3fs"], indirect=True)
def test_wrong_credentials_or_an_unreachable_endpoint_fail_every_rank_before_the_first_step(
    fsspec_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if fsspec_root.startswith("az://"):
        # An unreachable Azure endpoint fails too, after the Azure SDK's retries (about
        # 170 s here, which adlfs does not let a caller shorten): not run here.
        conn = str(_options_from_env(monkeypatch)["connection_string"])
        key = conn.split("AccountKey=")[1].split(";")[0]
        options: dict[str, Any] = {"connection_string": conn.replace(key, "d3Jvbmc=" * 11)}
        needle = "cannot be written .*(ClientAuthenticationError|HttpResponseError)"
    else:  # moto takes any key: the endpoint is wrong
        options = {"endpoint_url": "http://127.0.0.1:9",
                   "config_kwargs": {"retries": {"max_attempts": 1}}}  # fmt: skip
        needle = "cannot be written .*127.0.0.1:9"
    run_ranks(2, _every_rank_refused, fsspec_root, {"storage_options": options}, needle)


@pytest.mark.dist
@pytest.mark.parametrize("fsspec_root", ["azure"], indirect=True)
def test_the_cli_a_yaml_config_and_a_follower_carry_the_options_a_root_needs(
    fsspec_root: str,
    refs: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    options = _options_from_env(monkeypatch)
    config = config_file.load(
        JobConfig,
        None,
        [f"checkpoint.path={fsspec_root}",
         f"checkpoint.storage_options.connection_string={options['connection_string']}"],
    )  # fmt: skip
    assert config.checkpoint.storage_options == options
    storage = config.checkpoint.open_root()
    assert isinstance(storage, FsspecStorage) and storage.storage_options == options
    run_ranks(2, _saves_and_restores, fsspec_root, str(refs), {"storage_options": options})
    assert Manifest.load(storage).steps() == [2, 4]
    # Without its options the root cannot be opened; with them, every command reads it.
    assert cnr(["inspect", fsspec_root]) == 2
    capsys.readouterr()
    flag = ["--storage-options", json.dumps(options)]
    assert cnr([*flag, "verify", fsspec_root]) == 0
    assert cnr([*flag, "inspect", fsspec_root]) == 0
    assert fsspec_root in capsys.readouterr().out
    # A follower given the options serves the latest step, equal to the export of it.
    served = serving_model(TABLES, 4, "fp32")
    follower = Follower(fsspec_root, FloatTarget(served), FollowerOptions(storage_options=options))
    follower.poll()
    assert follower.reports[-1].step == 4
    want = export_state_dict(storage, 4)
    got = served.state_dict()
    assert want and all(torch.equal(v, got[k]) for k, v in want.items())


def _memory_root(root: str, refs: str) -> None:
    if dist.get_world_size() > 1:
        with pytest.raises(ValueError, match="lives in one process"):
            make_job(TABLES, root, seed=1, data_seed=4)
        return
    _saves_and_restores(root, refs, {})
    restores_exactly(TABLES, root, refs, 4, latest=True, seed=9, data_seed=4)


@pytest.mark.dist
def test_a_memory_root_checkpoints_in_one_process_and_is_refused_across_ranks(refs: Path) -> None:
    run_ranks(1, _memory_root, "memory://one/run", str(refs))
    run_ranks(2, _memory_root, "memory://two/run", str(refs))
