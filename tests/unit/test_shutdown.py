"""No library thread is left to the interpreter's finalization: a process that exits
while one runs a torch op, its owner never closed, still exits 0.

Python ends a daemon thread at finalization when it next takes the GIL; inside a torch
op that aborts the process ("terminate called without an active exception"). The
control run unregisters the exit hook and shows that abort on the same program.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from torchrec_cnr import shutdown

PROGRAM = textwrap.dedent(
    """
    import atexit, sys, time, torch
    from torchrec_cnr import shutdown
    from torchrec_cnr.tracking.tracker import _Marker

    x = torch.randn(1200, 1200)

    def busy():  # a batch whose marking is still in torch when the job exits
        end = time.perf_counter() + 0.8
        while time.perf_counter() < end:
            torch.mm(x, x)

    if sys.argv[1] == "control":
        atexit.unregister(shutdown.stop_all)
    marker = _Marker()
    marker.submit(busy)
    time.sleep(0.1)
    print("done", flush=True)  # the job's work is over; it never closes the tracker
    """
)


def _run(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", PROGRAM, mode],
        capture_output=True,
        text=True,
        timeout=60,
        env={"OMP_NUM_THREADS": "1", "PATH": ""},
    )


def test_a_thread_still_in_torch_at_exit_is_stopped_and_the_process_exits_zero() -> None:
    for _ in range(3):
        got = _run("hooked")
        assert got.returncode == 0 and got.stdout == "done\n", got.stderr[-2000:]


def test_without_the_exit_hook_the_same_program_aborts() -> None:
    aborted = [_run("control").returncode for _ in range(2)]
    assert any(rc != 0 for rc in aborted), f"the control never aborted: {aborted}"


class _Owner:
    def __init__(self, fail: bool = False) -> None:
        self.stopped = 0
        self.fail = fail

    def stop_thread(self) -> None:
        self.stopped += 1
        if self.fail:
            raise RuntimeError("stuck")


def test_stop_all_stops_each_registered_owner_once_and_forgets_unregistered_ones(
    caplog: pytest.LogCaptureFixture,
) -> None:
    live, gone, broken = _Owner(), _Owner(), _Owner(fail=True)
    for owner in (live, gone, broken):
        shutdown.register(owner)
    shutdown.unregister(gone)
    shutdown.stop_all()
    shutdown.stop_all()
    assert (live.stopped, gone.stopped, broken.stopped) == (1, 0, 1)
    assert "stuck" in caplog.text
