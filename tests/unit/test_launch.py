"""The library's launcher: a group of one outside torchrun, a clear error on a second
call, and the manager's warning under ``--max-restarts`` when the group came from
elsewhere. Each case runs in a process of its own: a process group cannot be unmade."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent(
    """
    import sys, warnings
    import torch.distributed as dist
    from torchrec_cnr import launch

    case = sys.argv[1]
    if case == "alone":
        launch.init_distributed()
        assert dist.get_world_size() == 1 and dist.get_backend() == "gloo"
        try:
            launch.init_distributed()
        except RuntimeError as e:
            print("second call:", e)
    else:
        if case == "plain":
            dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0,
                                    world_size=1)
        else:
            launch.init_distributed()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            launch.warn_if_restarts_unsafe()
        print("warned:", [str(w.message) for w in seen])
    dist.destroy_process_group()
    """
)


def _run(case: str, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "MASTER"))}
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM, case],
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_outside_torchrun_it_makes_a_group_of_one_and_refuses_a_second_call() -> None:
    out = _run("alone")
    assert "second call: init_distributed: a default process group exists already" in out


def test_a_group_made_elsewhere_under_max_restarts_is_warned_about() -> None:
    out = _run("plain", TORCHELASTIC_MAX_RESTARTS="1")
    assert "PyTorch issue 167288" in out and "init_distributed()" in out


def test_no_warning_without_restarts_or_with_the_launchers_group() -> None:
    assert "warned: []" in _run("plain", TORCHELASTIC_MAX_RESTARTS="0")
    assert "warned: []" in _run("launched", TORCHELASTIC_MAX_RESTARTS="3")
